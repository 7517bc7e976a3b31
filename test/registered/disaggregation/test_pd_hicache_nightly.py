"""The host tier on both sides of a PD pair (issue 58 item 4): a prefill server and a decode server (with
--disaggregation-decode-enable-radix-cache) each with --enable-hierarchical-cache and device pools of 6
state slots, behind the router. Turn 1 of a conversation, 8 other conversations that push it off both
servers' devices, then its turn 2: the prefill server loads its prefix from host and transfers KV and state
as usual, the decode server loads the part of the prompt its tree held from host (sealed before the
destination is cleared and sent: `HiMambaRadixCache.settle_host_copies`); every answer equals a single
server's (the prefill server asked without bootstrap fields) and the oracle's. The last case runs both
servers at --tp-size 2 (each rank its own host tier; the ranks compare their scheduler states whenever
they go idle under the suite's strict check). Nightly (~30-55 s a case):

    .venv/bin/python -m pytest -q test/registered/disaggregation/test_pd_hicache_nightly.py
"""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.pd_conversation import (
    LOGPROB_TOL,
    assert_same_generation,
    generate_body,
    internal_state,
    post,
)
from sglang.test.router_process import start_pd, stop_all
from sglang.test.scheduler_harness import token_ids

register_cpu_ci(est_time=150, suite="nightly-cpu")

SECRET = "pd-hicache-test-secret"
POOLS = ["--max-mamba-cache-size", "6", "--max-total-tokens", "2048", "--max-running-requests", "2",
         "--enable-hierarchical-cache", "--hicache-ratio", "8"]  # fmt: skip


@pytest.mark.parametrize(("decode_policy", "tp"), [("write_through", 1), ("write_back", 1), ("write_back", 2)])
def test_both_sides_of_a_pd_pair_hit_their_host_tier(preset_paths, oracles, decode_policy, tp):
    """write_back on the decode server backs a checkpoint up when its pages are evicted, which happens
    as a destination is allocated: without the settle the destination was cleared and written by the
    transfer before the backup read it, and turn 2 loaded those pages from host (a logprob off by more
    than the tolerance, measured)."""
    preset = "tiny-qwen3-next"
    env = {"SGLANG_DISAGGREGATION_SECRET": SECRET}
    pools = [*POOLS, "--tp-size", str(tp)]
    decode_args = ["--disaggregation-decode-enable-radix-cache", *pools, "--hicache-write-policy", decode_policy]
    prefill, decode, router, _ = start_pd(preset_paths[preset], pools, decode_args, env, env)
    try:

        def body(ids: list[int], n: int) -> dict:
            return generate_body(ids, n, logprob_start_len=-1)  # (input logprobs from 0 would take no hit)

        def ask(ids: list[int], n: int) -> dict:
            r = post(router.base_url + "/generate", body(ids, n))
            assert r.status_code == 200, r.text
            return r.json()

        a = token_ids(600, seed=1)  # (the prefill server keeps checkpoints every 256 tokens)
        turn1 = ask(a, 4)
        for i in range(8):
            ask(token_ids(300, seed=10 + i), 4)
        before = {"prefill": internal_state(prefill)["hicache"], "decode": internal_state(decode)["hicache"]}
        ids = a + turn1["output_ids"] + token_ids(20, seed=99)
        got = ask(ids, 6)
        after = {"prefill": internal_state(prefill)["hicache"], "decode": internal_state(decode)["hicache"]}
        loads = {k: after[k].get("load_states", 0) - before[k].get("load_states", 0) for k in after}
        assert loads["prefill"] >= 1 and loads["decode"] >= 1, (before, after)
        assert got["meta_info"]["cached_tokens"] >= 512  # (the prefill server's hit: turn 1 from host)
        want = post(prefill.base_url + "/generate", body(ids, 6)).json()
        assert_same_generation(got, want)
        ref = oracles[preset].token_logprobs(ids + got["output_ids"], start=len(ids)).tolist()
        lps = [lp for lp, _, _ in got["meta_info"]["output_token_logprobs"]]
        assert max(abs(g - w) for g, w in zip(lps, ref, strict=True)) < LOGPROB_TOL
        # A third turn right after: both trees hold turn 2 on the device, nothing more from host.
        ids3 = ids + got["output_ids"] + token_ids(10, seed=98)
        before3 = {"prefill": internal_state(prefill)["hicache"], "decode": internal_state(decode)["hicache"]}
        got3 = ask(ids3, 4)
        after3 = {"prefill": internal_state(prefill)["hicache"], "decode": internal_state(decode)["hicache"]}
        for k, stats in after3.items():
            assert stats.get("load_states", 0) == before3[k].get("load_states", 0), (k, before3, after3)
            assert stats.get("load_tokens", 0) == before3[k].get("load_tokens", 0), (k, before3, after3)
        assert_same_generation(got3, post(prefill.base_url + "/generate", body(ids3, 4)).json())
    finally:
        stop_all(prefill, decode, router)
