"""EAGLE / NEXTN under prefill/decode disaggregation (`disaggregation/draft_state.py`): a prefill and a
decode server, both with --speculative-algorithm NEXTN, behind the router, on the demo model (whose MTP
layer is trained, so drafts are accepted often). Greedy outputs equal plain decoding's, and per request
the drafts the decode server accepted (`spec_num_correct_drafts`) equal a single NEXTN server's (the
prefill server asked without bootstrap fields serves the request whole). The decode side drafts its
first verify from the MTP output the prefill server sent and from the prompt's MTP KV that moved with
the other layers'; a wrong one of either gives fewer accepted drafts (negative control: the prefill
server sends zeros for the MTP output, SGLANG_TEST_DISAGGREGATION_ZERO_DRAFT_STASH, and the decode
server accepts fewer). Every mamba strategy, one case with the decode server's radix cache and a second
turn that reuses its tree, one staged through host buffers in chunks, --tp-size 2 on both servers, TP 1
to TP 2, one on NIXL (where installed). Nightly (one PD pair per case, ~20 s each to start):

    .venv/bin/python -m pytest -q test/registered/disaggregation/test_pd_mtp_nightly.py
"""

from __future__ import annotations

import time

import pytest

from sglang.srt.disaggregation.nixl_backend import nixl_module
from sglang.test.ci_register import register_cpu_ci
from sglang.test.mtp_checks import DEMO, demo_outputs, held_out_prompts
from sglang.test.pd_conversation import internal_state, post
from sglang.test.router_process import start_pd, stop_all

register_cpu_ci(est_time=155, suite="nightly-cpu")  # (measured 113 s, seven PD pairs, NIXL included; +1 pair)

SECRET = "pd-mtp-test-secret"
SPEC = ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"]
NEW = 48  # (as `demo_outputs`)


def _body(ids: list[int]) -> dict:
    return {"input_ids": ids, "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}


def _ask(url: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[int]]:
    """Each prompt alone (the same batch shapes on both paths): its output ids and accepted drafts."""
    outs, accepted = [], []
    for ids in prompts:
        r = post(url + "/generate", _body(ids))
        assert r.status_code == 200, r.text
        out = r.json()
        outs.append(out["output_ids"])
        accepted.append(out["meta_info"].get("spec_num_correct_drafts", 0))
    return outs, accepted


def _pd(strategy: str, both: list[str], decode_extra: list[str], extra_env: dict[str, str], zero_stash=False):
    env = {"SGLANG_DISAGGREGATION_SECRET": SECRET, **extra_env}
    prefill_env = env | ({"SGLANG_TEST_DISAGGREGATION_ZERO_DRAFT_STASH": "1"} if zero_stash else {})
    from sglang.srt.configs.presets import resolve_model_path

    return start_pd(
        resolve_model_path(DEMO),
        [*SPEC, "--mamba-scheduler-strategy", strategy, *both],
        [*SPEC, "--mamba-scheduler-strategy", strategy, *both, *decode_extra],
        prefill_env,
        env,
    )


# Staged through host buffers small enough that a prompt's KV (its MTP layer's included) takes chunks.
STAGED = {
    "SGLANG_DISAGGREGATION_STAGING": "1",
    "SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": "0.1",
    "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "0.5",
}
NIXL = ["--disaggregation-transfer-backend", "nixl"]


@pytest.fixture(scope="module")
def prompts_and_plain():
    prompts = held_out_prompts(3, 96)
    return prompts, demo_outputs(prompts)[0]


@pytest.mark.parametrize(
    ("strategy", "both", "decode_extra", "env"),
    [
        ("no_buffer", [], [], {}),
        ("extra_buffer", [], ["--disaggregation-decode-enable-radix-cache"], {}),
        ("extra_buffer_lazy", [], [], STAGED),
        ("no_buffer", ["--tp-size", "2"], [], {}),  # (each rank's shard of the MTP KV; rank 0's row)
        # Prefill TP 1 -> decode TP 2: each decode rank's heads of the MTP layer's KV too (`shard_map`).
        ("extra_buffer_lazy", [], ["--tp-size", "2"], {}),
        pytest.param(
            "no_buffer", NIXL, [], {},
            marks=pytest.mark.skipif(nixl_module() is None, reason="NIXL is not installed (sglang[nixl])"),
        ),
    ],
)  # fmt: skip
def test_decode_server_accepts_what_a_single_server_does(strategy, both, decode_extra, env, prompts_and_plain):
    prompts, plain = prompts_and_plain
    prefill, decode, router, _ = _pd(strategy, both, decode_extra, env)
    try:
        single, single_accepted = _ask(prefill.base_url, prompts)
        pd, pd_accepted = _ask(router.base_url, prompts)
        assert single == plain and pd == plain
        assert sum(single_accepted) > 0
        assert pd_accepted == single_accepted, (single_accepted, pd_accepted)
        if env:  # (several chunks per prompt, the last one with the MTP output)
            assert internal_state(decode)["disaggregation"]["staged_chunks"] >= 2 * len(prompts)
        if "--disaggregation-decode-enable-radix-cache" in decode_extra:
            # A second turn: its prefix (the first turn, prompt and answer) is in the decode tree, MTP KV
            # included; only the rest moves, and the drafts accepted are still a single server's.
            turn = [p + o + p[:16] for p, o in zip(prompts, pd, strict=True)]
            before = internal_state(decode)["disaggregation"]["kv_tokens"]
            single2, single2_accepted = _ask(prefill.base_url, turn)
            pd2, pd2_accepted = _ask(router.base_url, turn)
            moved = internal_state(decode)["disaggregation"]["kv_tokens"] - before
            assert moved < sum(map(len, turn)) // 2  # (the tree held most of each prompt)
            assert pd2 == single2 and pd2_accepted == single2_accepted, (single2_accepted, pd2_accepted)
    finally:
        stop_all(prefill, decode, router)


def test_zeroed_draft_state_lowers_acceptance(prompts_and_plain):
    """Negative control: without the prefill server's MTP output the first verify drafts from zeros; the
    tokens stay plain decoding's (the verify decides them), the accepted drafts drop."""
    prompts, plain = prompts_and_plain
    prefill, decode, router, _ = _pd("no_buffer", [], [], {}, zero_stash=True)
    try:
        single, single_accepted = _ask(prefill.base_url, prompts)
        pd, pd_accepted = _ask(router.base_url, prompts)
        assert pd == plain
        assert sum(pd_accepted) < sum(single_accepted), (single_accepted, pd_accepted)
    finally:
        stop_all(prefill, decode, router)


def test_a_pair_where_one_server_drafts_is_refused_per_request():
    """A prefill server without the flag has no MTP layer in its KV pool: each request fails at its first
    destination with one sentence naming the flag, and the decode server holds nothing after it."""
    from sglang.srt.configs.presets import resolve_model_path

    env = {"SGLANG_DISAGGREGATION_SECRET": SECRET}
    prefill, decode, router, _ = start_pd(resolve_model_path(DEMO), [], SPEC, env, env)
    try:
        r = post(router.base_url + "/generate", _body(list(range(5, 40))))
        assert r.status_code == 500 and "same --speculative-algorithm" in r.text, r.text
        for _ in range(50):  # (the release may follow the reply by a scheduler step)
            state = internal_state(decode)
            if state["disaggregation"]["transfer_queue"] == 0 and state["token_usage"]["held_by_requests"] == 0:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"the decode server still holds the request: {state}")
    finally:
        stop_all(prefill, decode, router)
