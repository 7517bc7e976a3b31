"""--schedule-policy: lpm (longest cached prefix first) against fcfs on a shared-prefix workload whose
cache holds one prefix's checkpoint at a time: arrival order cycles through three prefixes and evicts
each before its next use; lpm keeps serving the cached one."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=10, suite="per-commit-cpu")

PRESET = "tiny-qwen3-next"


def _cached_tokens(policy: str, oracle) -> list[int]:
    h = SchedulerHarness(
        PRESET,
        schedule_policy=policy,
        mamba_scheduler_strategy="extra_buffer_lazy",
        max_mamba_cache_size=4,
        max_running_requests=1,
    )
    try:
        prefixes = [token_ids(200, seed=1 + i) for i in range(3)]
        for p in prefixes:
            h.generate(p, max_new_tokens=1)
        prompts = [prefixes[k % 3] + token_ids(10, seed=10 + k) for k in range(12)]
        rids = [h.submit(p, max_new_tokens=4) for p in prompts]
        h.run()
        for p, rid in zip(prompts, rids, strict=True):
            h.check_oracle(oracle, p, h.outputs[rid])
        h.flush_and_check_empty()
        return [h.outputs[rid].cached_tokens for rid in rids]
    finally:
        h.shutdown()


def test_lpm_serves_the_cached_prefix_first(oracles):
    fcfs = _cached_tokens("fcfs", oracles[PRESET])
    lpm = _cached_tokens("lpm", oracles[PRESET])
    # A hit is the prefix's final state (200) or its prefill snapshot (192).
    # fcfs: each request evicts the checkpoint the next one needs (measured: no hit at all).
    assert sum(c >= 192 for c in fcfs) <= 2, fcfs
    # lpm: after the first request of each group, every request hits its prefix's checkpoint.
    assert sum(c >= 192 for c in lpm) >= 9, lpm


def test_lpm_ranks_a_request_by_the_prefix_it_would_take():
    """A request that returns hidden states (or input logprobs from 0) takes none of its cached prefix:
    lpm ranks it behind a request whose shorter prefix it would use."""
    from sglang.srt.managers.schedule_batch import Req

    h = SchedulerHarness(PRESET, schedule_policy="lpm", enable_return_hidden_states=True)
    try:
        long_prefix, short_prefix = token_ids(200, seed=1), token_ids(80, seed=2)
        for p in (long_prefix, short_prefix):
            h.generate(p, max_new_tokens=1)
        plain = Req("plain", short_prefix + token_ids(5, seed=3))
        hidden = Req("hidden", long_prefix + token_ids(5, seed=4))
        hidden.return_hidden_states = True
        ids = long_prefix + token_ids(5, seed=5)
        logprobs = Req("logprobs", ids, return_logprob=True, logprob_start_len=0)
        assert h.sched.policy.calc_priority([hidden, logprobs, plain]) == [plain, hidden, logprobs]
        hidden.return_hidden_states = False  # then its long prefix ranks first
        assert h.sched.policy.calc_priority([plain, hidden])[0] is hidden
    finally:
        h.shutdown()
