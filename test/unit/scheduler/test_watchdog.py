"""--watchdog-timeout: a forward that does not finish in time is reported with the batch it ran (the
scheduler process then exits non-zero instead of hanging), whether the forward stream is a thread of its
own or runs on the scheduler thread (the CPU default)."""

from __future__ import annotations

import pytest

from sglang.srt.environ import envs
from sglang.srt.managers.scheduler import SchedulerWatchdogError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=8, suite="per-commit-cpu")


@pytest.mark.parametrize("thread", [True, False], ids=["stream-thread", "inline"])
def test_stuck_forward_is_reported_with_its_batch(thread):
    with envs.SGLANG_CPU_FORWARD_THREAD.override(thread):
        h = SchedulerHarness("tiny-qwen3-next", watchdog_timeout=0.3, disable_overlap_schedule=True)
    try:
        assert h.sched.worker.inline is not thread
        rid = h.submit(token_ids(40, seed=1), max_new_tokens=2)
        with envs.SGLANG_TEST_FORWARD_DELAY_MS.override(1500.0):
            with pytest.raises(SchedulerWatchdogError, match=r"batch 1 \(extend, 1 requests, 40 tokens") as e:
                h.sched.step()
        assert rid in str(e.value) and "--watchdog-timeout 0.3 s" in str(e.value)
    finally:
        h.shutdown()


def test_no_timeout_when_the_forward_finishes_in_time():
    h = SchedulerHarness("tiny-qwen3-next", watchdog_timeout=5.0)
    try:
        out = h.generate(token_ids(40, seed=2), max_new_tokens=3)
        assert out.finished_reason == {"type": "length", "length": 3}
    finally:
        h.shutdown()
