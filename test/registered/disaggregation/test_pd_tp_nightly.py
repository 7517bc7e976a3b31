"""Prefill/decode disaggregation under tensor parallelism (issues 54, 56): the real `sglang-router` in PD
mode in front of a prefill server and a decode server of one or two gloo ranks each (real processes,
loopback, Mooncake's TCP transfer engine, each rank its own engine and pools), against a single server
at --tp-size 1. --tp-size 2 on both servers: Qwen3-Next (Gated DeltaNet) and Nemotron-H (Mamba2), Qwen3-Next
with --ep-size 2 on the prefill server only, and Qwen3-Next through the staged path (each rank's host
staging buffers, in chunks). Other --tp-size on each side: Qwen3-Next from TP 2 (and --ep-size 2) to TP 1
with the decode radix cache, from TP 1 to TP 2, and staged from TP 2 to TP 1; Nemotron-H from TP 1 to TP 2.

At one --tp-size each prefill rank holds its own KV heads and its own linear-attention heads' state and
writes them into the decode rank of the same index (`disaggregation/pd_ranks.py`); at another, each decode
rank's KV heads and state rows are written by the prefill rank holding them (`shard_map.py`: TP 2 -> 1
writes each prefill rank's halves of q | k | v at their offsets; TP 1 -> 2 writes each decode rank its
part, Nemotron-H's B and C groups replicated on both). Greedy tokens equal the TP-1 server's, logprobs
within 1e-4: float32 on both sides; TP 2 sums a row-parallel layer's two halves where TP 1 sums the whole
row (another order of the same float32 additions, ~1e-6 at these sizes: test_tp_engine.py measures it),
and the decode side reads its prompt KV from another page layout (pd_conversation.LOGPROB_TOL). Both
servers sign their PD messages, so the decode server's hello reaches only the prefill server's rank 0,
whose proof every decode rank learns. After every test both servers are idle with nothing held by
requests, and their ranks agreed on their scheduler states each time they went idle
(SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE, as in the suite).

    .venv/bin/python -m pytest -q test/registered/disaggregation/test_pd_tp_nightly.py
"""

from __future__ import annotations

import base64
import pickle
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import served_tensors
from sglang.test.pd_conversation import (
    assert_quiescent,
    assert_same_generation,
    conversation_turns,
    generate_body,
    internal_state,
    post,
    prompts,
)
from sglang.test.router_process import start_pd, stop_all
from sglang.test.test_utils import ServerProcess

register_cpu_ci(est_time=700, suite="nightly-cpu")

FAIL_PREFIX = "fail-transfer-"
SECRET = "pd-tp-test-secret"
TP = ["--tp-size", "2"]
RADIX = ["--disaggregation-decode-enable-radix-cache"]
# (preset, prefill flags, decode flags, both servers' environment): Qwen3-Next moves KV across page
# sizes (16 -> 1); Nemotron-H's prefill server chunks its prompts and keeps extra-buffer checkpoints, its
# decode server a radix cache of its own; the staged Qwen3-Next pair moves each rank's shard through its
# host staging buffers in chunks of 10 KiB (a rank's KV is 64 bytes a position and its state ~8.5 KB, so
# prompts of ~30 positions or more move in two chunks or more, each acknowledged before the next).
PAIRS = {
    "qwen3-next": ("tiny-qwen3-next", [*TP, "--page-size", "16"], [*TP, "--page-size", "1"], {}),
    "nemotron-h": (
        "tiny-nemotron-h",
        [*TP, "--mamba-scheduler-strategy", "extra_buffer", "--chunked-prefill-size", "128"],
        [*TP, *RADIX, "--mamba-scheduler-strategy", "no_buffer"],
        {},
    ),
    # Another --ep-size on each side (the experts whole on each prefill rank, split on each decode rank):
    # EP moves only the experts, the pools are sharded by TP alike, and the weights' fingerprint does not
    # depend on the sharding (`weights_fingerprint.py`).
    "qwen3-next-ep": ("tiny-qwen3-next", [*TP, "--ep-size", "2"], TP, {}),
    "qwen3-next-staged": (
        "tiny-qwen3-next",
        TP,
        TP,
        {"SGLANG_DISAGGREGATION_STAGING": "1", "SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": "0.01",
         "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "0.05"},  # fmt: skip
    ),
    # Other --tp-size on each side (`shard_map.py`).
    "qwen3-next-2-to-1": (
        "tiny-qwen3-next",
        [*TP, "--ep-size", "2", "--page-size", "16"],
        ["--page-size", "1", *RADIX, "--mamba-scheduler-strategy", "extra_buffer_lazy"],
        {},
    ),
    "qwen3-next-1-to-2": (
        "tiny-qwen3-next",
        ["--mamba-scheduler-strategy", "extra_buffer", "--chunked-prefill-size", "128"],
        TP,
        {},
    ),
    "nemotron-h-1-to-2": ("tiny-nemotron-h", [], [*TP, *RADIX, "--mamba-scheduler-strategy", "no_buffer"], {}),
    # Staged from TP 2 to TP 1 (`staged_route.py`): each prefill rank writes its halves of each chunk into
    # the decode rank's range, unpacked once both have written it (a position: 64 bytes on a prefill rank,
    # 128 on the decode rank; the state ~17 KB there: several chunks a prompt).
    "qwen3-next-staged-2-to-1": (
        "tiny-qwen3-next",
        TP,
        [],
        {"SGLANG_DISAGGREGATION_STAGING": "1", "SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": "0.02",
         "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "0.1"},  # fmt: skip
    ),
}
SIZING = ["--max-running-requests", "8", "--max-total-tokens", "8192", "--max-mamba-cache-size", "48"]


@pytest.fixture(scope="module", params=list(PAIRS))
def pd(request, preset_paths):
    preset, prefill_args, decode_args, env = PAIRS[request.param]
    path = preset_paths[preset]
    single = ServerProcess(["--model-path", path, *SIZING])
    prefill = decode = router = None
    try:
        prefill, decode, router, _ = start_pd(
            path,
            [*SIZING, *prefill_args],
            [*SIZING, *decode_args],
            prefill_env={"SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER": FAIL_PREFIX,
                         "SGLANG_DISAGGREGATION_SECRET": SECRET, **env},  # fmt: skip
            decode_env={"SGLANG_DISAGGREGATION_SECRET": SECRET, **env},
            # (the failure tests fail requests on purpose: the router retries each, and ten failures
            # would open its circuit breaker for 60 s, failing the next tests with 503 "all circuits open")
            router_args=["--disable-circuit-breaker"],
        )
        single.wait_ready()
        yield {"prefill": prefill, "decode": decode, "router": router, "single": single, "model": path,
               "staged": bool(env), "prefill_tp": 2 if "--tp-size" in prefill_args else 1,
               "radix": RADIX[0] in decode_args}  # fmt: skip
    finally:
        stop_all(router, decode, prefill, single)


@pytest.fixture(autouse=True)
def nothing_held_afterwards(request):
    yield
    if "pd" in request.fixturenames:
        pd = request.getfixturevalue("pd")
        for name in ("prefill", "decode"):
            assert_quiescent(pd[name], name)


def test_tp2_pair_matches_a_tp1_server(pd):
    before = internal_state(pd["prefill"])["disaggregation"]
    decode = internal_state(pd["decode"])["disaggregation"]
    assert before["tp_size"] == pd["prefill_tp"] and 2 in (before["tp_size"], decode["tp_size"])
    # Each server's fingerprint is its meta digest and the sum of its ranks' shares (16 + 16 hex digits):
    # equal for the same weights sharded otherwise.
    assert len(before["weights_fingerprint"]) == 32 and before["weights_fingerprint"] == decode["weights_fingerprint"]
    for ids in prompts(8):
        want = post(pd["single"].base_url + "/generate", generate_body(ids)).json()
        r = post(pd["router"].base_url + "/generate", generate_body(ids))
        assert r.status_code == 200, r.text
        assert_same_generation(r.json(), want)
    after = internal_state(pd["prefill"])["disaggregation"]
    tokens = after["kv_tokens"] - before["kv_tokens"]
    assert after["transfers"] - before["transfers"] == 8 and after["failed_transfers"] == 0
    # Every decode rank's shard moved once: the decode ranks' sizes together (at one --tp-size the prefill
    # ranks' too; a Mamba2 group replicated on two decode ranks counts on each).
    assert after["bytes"] - before["bytes"] == tokens * decode["kv_bytes_per_token"] + 8 * decode["state_bytes"]
    decode = internal_state(pd["decode"])["disaggregation"]
    assert decode["transfers"] >= 8 and decode["failed_transfers"] == 0
    if pd["staged"]:  # the longer prompts moved in several chunks (each a chunk on both ranks)
        assert decode["staged_chunks"] > decode["transfers"], decode


def test_concurrent_requests_match_a_tp1_server(pd):
    bodies = [generate_body(ids, max_new_tokens=10) for ids in prompts(6, base=17)]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda b: post(pd["router"].base_url + "/generate", b, timeout=180), bodies))
    for body, r in zip(bodies, got, strict=True):
        assert r.status_code == 200, r.text
        assert_same_generation(r.json(), post(pd["single"].base_url + "/generate", body).json())


def test_a_conversation_moves_what_the_decode_side_lacks(pd):
    """Each turn's answer equals the prefill server's own (asked without bootstrap fields); with the
    decode radix cache a later turn moves only the KV past what the decode ranks hold."""
    base = prompts(1, base=23)[0] + list(range(3, 90))
    moved = conversation_turns(pd, base, [[7, 8, 9], [10, 11, 12, 13]])
    if pd["radix"]:
        assert moved[1] < len(base) and moved[2] < len(base), moved


def test_a_failed_transfer_is_an_error_on_every_rank(pd):
    body = generate_body(prompts(1)[0], rid=FAIL_PREFIX + "1")
    r = post(pd["router"].base_url + "/generate", body, timeout=120)
    assert r.status_code >= 500, r.text
    # (the rank whose failure the ranks gathered first: both fail at once, either may be first)
    named = "(on TP rank 0)" in r.text or "(on TP rank 1)" in r.text
    assert "injected" in r.text and named == (pd["prefill_tp"] > 1), r.text
    assert internal_state(pd["prefill"])["disaggregation"]["failed_transfers"] >= 1
    assert internal_state(pd["decode"])["disaggregation"]["failed_transfers"] >= 1


def test_a_transfer_failed_on_one_rank_stops_the_other_and_names_that_rank(pd):
    """Review findings 4 and 6 (issue 56): rank 1's write fails at once while rank 0's runs (staged: rank
    0 wrote its first chunk and waits for an acknowledgement that cannot come, the chunk never being
    announced). The request fails with rank 1's error, soon: rank 0's transfer is stopped in the step
    that gathers rank 1's failure, not at its 60 s acknowledgement timeout."""
    if pd["prefill_tp"] == 1:
        pytest.skip("one prefill rank")
    body = generate_body(prompts(8)[7], rid=FAIL_PREFIX + "rank1-1")  # (300 positions: several chunks)
    start = time.monotonic()
    r = post(pd["router"].base_url + "/generate", body, timeout=120)
    seconds = time.monotonic() - start
    assert r.status_code >= 500, r.text
    assert "injected" in r.text and "(on TP rank 1)" in r.text, r.text
    assert seconds < 30, seconds  # (a prefill and a decode step here take well under a second)


def _update(server: ServerProcess, name: str, tensor, version: str) -> None:
    body = {"serialized_named_tensors": [base64.b64encode(pickle.dumps([(name, tensor)])).decode()],
            "weight_version": version}  # fmt: skip
    r = requests.post(server.base_url + "/update_weights_from_tensor", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["success"], r.text


def test_a_weight_update_on_one_server_is_refused_until_the_other_has_it(pd):
    """Each rank fingerprints its own shard again after an update, and the ranks gather them again: a
    projection sharded across the ranks, its last element (on the last rank) nudged on the decode server
    only, is refused (the servers' totals, every rank's share summed, differ); once the prefill server has
    it too the pair serves the prefill server's own answer. (Last: the original weight goes back to both,
    so that the pair again matches the TP-1 server.)"""
    tensors = served_tensors(pd["model"])
    name = next(n for n in sorted(tensors) if n.endswith("proj.weight") and tensors[n].dim() == 2)
    nudged = tensors[name].clone()
    nudged.view(-1)[-1] += 1e-3 * max(1.0, abs(float(nudged.view(-1)[-1])))
    body = generate_body(prompts(1, base=31)[0], max_new_tokens=6)
    try:
        _update(pd["decode"], name, nudged, "step-1")
        r = post(pd["router"].base_url + "/generate", body)
        assert r.status_code >= 500, r.text
        assert "the weights' values differ" in r.text and "step-1" in r.text, r.text
        _update(pd["prefill"], name, nudged, "step-1")
        r = post(pd["router"].base_url + "/generate", body)
        assert r.status_code == 200, r.text
        assert_same_generation(r.json(), post(pd["prefill"].base_url + "/generate", body).json())
    finally:
        for side in ("decode", "prefill"):
            _update(pd[side], name, tensors[name], "default")
