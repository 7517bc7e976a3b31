"""The scheduler's `loop_times` (`scheduler_components/loop_times.py`): batches counted by kind and the
loop's parts summed as they run, reported by `get_internal_state`."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=4, suite="per-commit-cpu")


def test_loop_times_count_batches_and_sum_the_parts():
    h = SchedulerHarness(disable_overlap_schedule=True)
    try:
        before = h.sched.get_internal_state()["loop_times"]
        assert before["prefill_batches"] == before["decode_batches"] == 0 and before["forward"] == 0
        for seed in range(2):
            h.submit(token_ids(30, seed=seed), max_new_tokens=5)
        h.run()
        times = h.sched.get_internal_state()["loop_times"]
        # One prefill for both prompts, whose first tokens come from it; then 4 decode steps.
        assert (times["prefill_batches"], times["decode_batches"]) == (1, 4)
        assert all(times[k] > 0 for k in ("build", "launch", "wait", "process", "forward"))
        # Inline on CPU: the forward runs inside the launch, and its result is there at once.
        assert times["forward"] <= times["launch"]
        assert times["idle"] == times["intake"] == 0  # the harness feeds the scheduler, not its loop
    finally:
        h.shutdown()
