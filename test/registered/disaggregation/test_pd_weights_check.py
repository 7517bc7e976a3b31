"""A prefill/decode pair serving different weights of the same shapes is refused, not answered with
tokens neither server would give (`disaggregation/weights_fingerprint.py`): the decode server serves
another seed of the prefill server's preset (a fine-tune's situation), then is updated from disk to the
prefill server's checkpoint, then one server gets an in-place tensor update the other lacks. Each
refusal names what differs and leaves both servers holding nothing; each pair of equal weights serves the
prefill server's own answers. Real processes: both servers and `sglang-router` in PD mode, Mooncake TCP."""

from __future__ import annotations

import base64
import json
import pickle
import shutil
import time

import pytest
import requests

from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import served_tensors
from sglang.test.pd_checkpoints import other_seed_checkpoint
from sglang.test.pd_conversation import generate_body, internal_state, post
from sglang.test.router_process import start_pd, stop_all

register_cpu_ci(est_time=26, suite="per-commit-cpu")

PRESET = "tiny-qwen3-next"
SECRET = "pd-weights-check-secret"
IDS = [(5 * j + 11) % 400 + 3 for j in range(40)]


@pytest.fixture(scope="module")
def pair(preset_paths):
    a, b = preset_paths[PRESET], other_seed_checkpoint(PRESET, seed=1)
    env = {"SGLANG_DISAGGREGATION_SECRET": SECRET}
    prefill, decode, router, _ = start_pd(
        a, [], ["--model-path", b], prefill_env=env, decode_env=env, router_args=["--retry-max-retries", "1"]
    )
    try:
        yield {"prefill": prefill, "decode": decode, "router": router, "a": a, "b": b}
    finally:
        stop_all(router, decode, prefill)


def held(server, timeout: float = 15) -> tuple:
    """What the server holds for requests once they are answered: (0, 0, 0, 0, {}) when nothing."""
    deadline = time.monotonic() + timeout
    while True:
        state = internal_state(server)
        pd = {k: v for k, v in state["disaggregation"].items() if k in ("rooms", "transfer_queue", "ready") and v}
        out = (state["num_running_reqs"], state["num_waiting_reqs"], state["token_usage"]["held_by_requests"],
               state["mamba_usage"]["held_by_requests"], pd)  # fmt: skip
        if out == (0, 0, 0, 0, {}) or time.monotonic() > deadline:
            return out
        time.sleep(0.2)


def refused(pair, *words: str) -> None:
    r = post(pair["router"].base_url + "/generate", generate_body(IDS, max_new_tokens=4))
    assert r.status_code != 200, f"a pair of different weights served {r.text[:300]}"
    for word in ("the weights' values differ", "--model-path", *words):
        assert word in r.text, r.text
    for side in ("prefill", "decode"):
        assert held(pair[side]) == (0, 0, 0, 0, {}), side


def served(pair) -> None:
    body = generate_body(IDS, max_new_tokens=6)
    r = post(pair["router"].base_url + "/generate", body)
    assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == post(pair["prefill"].base_url + "/generate", body).json()["output_ids"]
    fingerprints = {internal_state(pair[s])["disaggregation"]["weights_fingerprint"] for s in ("prefill", "decode")}
    assert len(fingerprints) == 1 and "" not in fingerprints


def test_another_checkpoint_is_refused_until_both_serve_the_same(pair):
    refused(pair, pair["a"], pair["b"])
    r = post(pair["decode"].base_url + "/update_weights_from_disk", {"model_path": pair["a"]})
    assert r.status_code == 200 and r.json()["success"], r.text
    served(pair)


def test_a_tensor_update_on_one_server_is_refused_until_the_other_has_it(pair):
    """An RL refit step sent to the decode server only: one element of one tensor, by 1e-6 of itself.
    (After the first test: both servers serve the preset.)"""
    name, tensor = sorted(served_tensors(pair["a"]).items())[5]
    nudged = tensor.clone()
    nudged.view(-1)[3] = nudged.view(-1)[3] + 1e-6 * max(1.0, abs(float(nudged.view(-1)[3])))
    assert not nudged.equal(tensor)
    body = {"serialized_named_tensors": [base64.b64encode(pickle.dumps([(name, nudged)])).decode()],
            "weight_version": "step-1", "flush_cache": True}  # fmt: skip
    r = requests.post(pair["decode"].base_url + "/update_weights_from_tensor", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    refused(pair, "step-1")
    r = requests.post(pair["prefill"].base_url + "/update_weights_from_tensor", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["success"], r.text
    served(pair)


def test_a_config_of_its_own_is_refused_and_a_copy_elsewhere_is_not(pair, tmp_path):
    """The model's config counts, not the folder it was read from: the prefill server back on the preset,
    the decode server on a copy of it in another folder serves; on a copy whose config.json alone differs
    (rms_norm_eps, same weights) it is refused. (After the tests above: both hold the nudged tensor.)"""
    same, eps = tmp_path / "same", tmp_path / "eps"
    for copy in (same, eps):
        shutil.copytree(pair["a"], copy)
    config = json.loads((eps / "config.json").read_text())
    config["rms_norm_eps"] *= 10
    (eps / "config.json").write_text(json.dumps(config))
    for side, path in (("prefill", pair["a"]), ("decode", str(same))):
        r = post(pair[side].base_url + "/update_weights_from_disk", {"model_path": path})
        assert r.status_code == 200 and r.json()["success"], r.text
    served(pair)
    r = post(pair["decode"].base_url + "/update_weights_from_disk", {"model_path": str(eps)})
    assert r.status_code == 200 and r.json()["success"], r.text
    refused(pair, str(eps))
