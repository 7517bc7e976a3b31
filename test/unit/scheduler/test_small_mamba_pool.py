"""A mamba pool of 8 slots under 32 concurrent requests: requests queue instead of crashing, more than
one runs at a time, every request finishes correctly within a time bound, and nothing leaks."""

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
def test_32_requests_on_8_slots(preset, strategy, oracles):
    h = SchedulerHarness(
        preset,
        mamba_scheduler_strategy=strategy,
        max_mamba_cache_size=8,
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
        assert peak <= 8 // sched.pool_sizes.resident_slots_per_req
        for p, rid in zip(prompts, rids, strict=True):
            out = h.outputs[rid]
            assert out.finished_reason == {"type": "length", "length": 12}
            h.check_oracle(oracles[preset], p, out)
        h.flush_and_check_empty()
    finally:
        h.shutdown()
