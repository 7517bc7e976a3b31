"""Prefill/decode disaggregation between servers of different --tp-size (and --ep-size): the real
`sglang-router` in PD mode in front of a prefill server and a decode server whose TP ranks hold other
shards (real processes, loopback, Mooncake's TCP transfer engine, each rank its own engine and pools),
against a single server at --tp-size 1.

Each decode rank's KV heads and recurrent-state rows are written by a prefill rank that holds them
(`disaggregation/shard_map.py`): at prefill TP 2 -> decode TP 1 both prefill ranks write their halves
into the one decode rank (Qwen3-Next's GDN conv state is q | k | v, each half of each sub-block at its
own offset; the prefill server also runs --ep-size 2, so its experts are sharded otherwise than the
decode server's, and the weights' fingerprint must still agree); at prefill TP 1 -> decode TP 2 the one
prefill rank writes each decode rank its part (Nemotron-H's Mamba2 conv state x | B | C, its B and C
groups replicated on both decode ranks where the TP size exceeds them). Greedy tokens equal the TP-1
server's, logprobs within 1e-4 (`pd_conversation.LOGPROB_TOL`: float32 on both sides, the TP ranks sum
a row-parallel layer's halves in another order, ~1e-6 at these sizes). After every test both servers
are idle with nothing held by requests.

    .venv/bin/python -m pytest -q test/registered/disaggregation/test_pd_tp_mixed_nightly.py
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang.test.ci_register import register_cpu_ci
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

register_cpu_ci(est_time=120, suite="nightly-cpu")

FAIL_PREFIX = "fail-transfer-"
SECRET = "pd-tp-mixed-test-secret"
# (preset, prefill flags, decode flags)
PAIRS = {
    "qwen3-next-2-to-1": (
        "tiny-qwen3-next",
        ["--tp-size", "2", "--ep-size", "2", "--page-size", "16"],
        ["--page-size", "1", "--disaggregation-decode-enable-radix-cache",
         "--mamba-scheduler-strategy", "extra_buffer_lazy"],  # fmt: skip
    ),
    "qwen3-next-1-to-2": (
        "tiny-qwen3-next",
        ["--mamba-scheduler-strategy", "extra_buffer", "--chunked-prefill-size", "128"],
        ["--tp-size", "2"],
    ),
    "nemotron-h-1-to-2": (
        "tiny-nemotron-h",
        [],
        ["--tp-size", "2", "--disaggregation-decode-enable-radix-cache", "--mamba-scheduler-strategy",
         "no_buffer"],  # fmt: skip
    ),
}
SIZING = ["--max-running-requests", "8", "--max-total-tokens", "8192", "--max-mamba-cache-size", "48"]


@pytest.fixture(scope="module", params=list(PAIRS))
def pd(request, preset_paths):
    preset, prefill_args, decode_args = PAIRS[request.param]
    path = preset_paths[preset]
    single = ServerProcess(["--model-path", path, *SIZING])
    prefill = decode = router = None
    try:
        prefill, decode, router, _ = start_pd(
            path,
            [*SIZING, *prefill_args],
            [*SIZING, *decode_args],
            prefill_env={"SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER": FAIL_PREFIX,
                         "SGLANG_DISAGGREGATION_SECRET": SECRET},  # fmt: skip
            decode_env={"SGLANG_DISAGGREGATION_SECRET": SECRET},
            # (the failure tests fail requests on purpose: the router retries each, and ten failures
            # would open its circuit breaker for 60 s, failing the next tests with 503 "all circuits open")
            router_args=["--disable-circuit-breaker"],
        )
        single.wait_ready()
        yield {"prefill": prefill, "decode": decode, "router": router, "single": single, "model": path,
               "name": request.param}  # fmt: skip
    finally:
        stop_all(router, decode, prefill, single)


@pytest.fixture(autouse=True)
def nothing_held_afterwards(request):
    yield
    if "pd" in request.fixturenames:
        pd = request.getfixturevalue("pd")
        for name in ("prefill", "decode"):
            assert_quiescent(pd[name], name)


def test_the_pair_matches_a_tp1_server(pd):
    before = internal_state(pd["prefill"])["disaggregation"]
    decode = internal_state(pd["decode"])["disaggregation"]
    assert before["tp_size"] != decode["tp_size"], (before["tp_size"], decode["tp_size"])
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
    # What moved is every decode rank's shard once: their sizes together (a replicated Mamba2 group
    # counts once per decode rank that holds it).
    assert after["bytes"] - before["bytes"] == tokens * decode["kv_bytes_per_token"] + 8 * decode["state_bytes"]


def test_concurrent_requests_match_a_tp1_server(pd):
    bodies = [generate_body(ids, max_new_tokens=10) for ids in prompts(6, base=17)]
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda b: post(pd["router"].base_url + "/generate", b, timeout=180), bodies))
    for body, r in zip(bodies, got, strict=True):
        assert r.status_code == 200, r.text
        assert_same_generation(r.json(), post(pd["single"].base_url + "/generate", body).json())


def test_a_conversation_moves_what_the_decode_side_lacks(pd):
    """Each turn's answer equals the prefill server's own; with the decode radix cache a later turn moves
    only the KV past what the decode ranks hold."""
    base = prompts(1, base=23)[0] + list(range(3, 90))
    moved = conversation_turns(pd, base, [[7, 8, 9], [10, 11, 12, 13]])
    if "radix" in " ".join(PAIRS[pd["name"]][2]):
        assert moved[1] < len(base) and moved[2] < len(base), moved


def test_a_failed_transfer_fails_its_request_only(pd):
    r = post(pd["router"].base_url + "/generate", generate_body(prompts(1)[0], rid=FAIL_PREFIX + "1"))
    assert r.status_code >= 500 and "injected" in r.text, r.text
    ok = post(pd["router"].base_url + "/generate", generate_body(prompts(2)[1]))
    assert ok.status_code == 200, ok.text
