"""A small mamba pool under many concurrent requests: requests queue instead of crashing, more than one
runs at a time, every request finishes correctly within a time bound, and nothing leaks; the derived
running cap leaves the radix tree room, so a saturated pool still serves shared prefixes from the cache."""

from __future__ import annotations

import time

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=40, suite="per-commit-cpu")

# A generous bound for 32 short requests on 2 busy cores; a livelock or a stall would blow it.
TIME_BOUND_S = 60


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
@pytest.mark.parametrize("strategy", ["no_buffer", "extra_buffer", "extra_buffer_lazy"])
def test_32_requests_on_12_slots(preset, strategy, oracles):
    h = SchedulerHarness(
        preset,
        mamba_scheduler_strategy=strategy,
        max_mamba_cache_size=12,
        max_running_requests=None,
        mamba_track_interval=64,
    )
    sched = h.sched
    try:
        shared = token_ids(70, seed=30)
        prompts = [shared + token_ids(10 + k % 7, seed=31 + k) for k in range(32)]
        rids = [h.submit(p, max_new_tokens=12) for p in prompts]
        peak = 0
        start = time.monotonic()
        while sched.step():
            peak = max(peak, len(sched.running))
            if not sched.in_flight:
                sched.check_integrity()
            assert time.monotonic() - start < TIME_BOUND_S
        h.collect()
        assert peak > 1, "requests must run concurrently"
        assert peak <= sched.max_running_requests == 12 // sched.server_args.mamba_strategy.slots_per_running_req
        for p, rid in zip(prompts, rids, strict=True):
            out = h.outputs[rid]
            assert out.finished_reason == {"type": "length", "length": 12}
            h.check_oracle(oracles[preset], p, out)
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_a_saturated_pool_still_hits_a_shared_prefix(strategy):
    """24 requests queued at once behind a 130-token shared prefix, on 16 slots with the derived running
    cap: the tree keeps room beside the running requests for the checkpoint taken where the prompts branch,
    so the requests after the first wave hit it. (With a cap of 16 // resident slots the running requests held every
    slot, each checkpoint was evicted by the next admission, and no request hit the cache.) `no_buffer` takes
    no checkpoint inside a prompt, so distinct suffixes never hit there, by design."""
    h = SchedulerHarness(
        "tiny-qwen3-next",
        mamba_scheduler_strategy=strategy,
        max_mamba_cache_size=16,
        max_running_requests=None,
        mamba_track_interval=64,
    )
    sched = h.sched
    try:
        strat = sched.server_args.mamba_strategy
        assert strat.slots_per_running_req == strat.resident_slots_per_req + 2
        assert sched.max_running_requests == 16 // strat.slots_per_running_req
        shared = token_ids(130, seed=40)
        # Suffixes past the next lattice point (so a prompt's own snapshot is not the shared one) and
        # staggered lengths (one finish, then one admission: the steady state of a saturated server).
        rids = [h.submit(shared + token_ids(100, seed=41 + k), max_new_tokens=4 + 2 * k) for k in range(24)]
        h.run()
        cached = [h.outputs[rid].cached_tokens for rid in rids]
        later_waves = cached[sched.max_running_requests :]
        # The shared prefix's checkpoint sits on the cache chunk lattice (64): at least 64 tokens each.
        assert sum(c >= 64 for c in later_waves) >= len(later_waves) // 2, cached
        h.flush_and_check_empty()
    finally:
        h.shutdown()
