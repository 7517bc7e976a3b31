"""The forward stream on the scheduler thread (the CPU default, `forward_worker.py`): a batch runs at
launch, the overlap schedule still launches N+1 before it processes N and stays oracle-exact, and a
forward that raises fails the scheduler where it takes that batch's result, as with a thread."""

from __future__ import annotations

import threading
import time

import pytest

from sglang.srt.environ import envs
from sglang.srt.managers import scheduler as scheduler_module
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=9, suite="per-commit-cpu")

PRESET = "tiny-qwen3-next"


def test_cpu_default_runs_each_batch_at_launch_on_the_scheduler_thread(oracles):
    h = SchedulerHarness(PRESET, mamba_scheduler_strategy="extra_buffer_lazy")
    try:
        assert h.sched.worker.inline and h.sched.enable_overlap and h.sched.worker._thread is None
        ran_on = []
        h.sched.worker.before_batch_hooks.append(lambda item: ran_on.append(threading.get_ident()))
        h.sched.record_events = True
        prompt = token_ids(60, seed=3)
        rid = h.submit(prompt, max_new_tokens=12)
        h.run()
        assert set(ran_on) == {threading.get_ident()}
        # Overlap: the decode batch N+1 is launched before N is processed.
        events = h.sched.events
        assert any(
            events[i] == ("launch", n + 1) and ("process", n) in events[i + 1 :]
            for i in range(len(events))
            for n in range(1, 12)
        ), events
        h.check_oracle(oracles[PRESET], prompt, h.outputs[rid])
        h.flush_and_check_empty()
    finally:
        h.shutdown()


def test_thread_on_request():
    with envs.SGLANG_CPU_FORWARD_THREAD.override(True):
        h = SchedulerHarness(PRESET)
    try:
        assert not h.sched.worker.inline and h.sched.worker._thread.is_alive()
    finally:
        h.shutdown()
    assert not h.sched.worker._thread.is_alive()


def test_a_forward_that_raises_fails_the_step_that_takes_its_result():
    h = SchedulerHarness(PRESET, disable_overlap_schedule=True)

    def boom(item):
        raise RuntimeError("forward exploded")

    try:
        h.submit(token_ids(40, seed=4), max_new_tokens=2)
        h.sched.worker.before_batch_hooks.append(boom)
        with pytest.raises(RuntimeError, match="forward exploded"):
            h.sched.step()
    finally:
        h.sched.worker.before_batch_hooks.clear()
        h.shutdown()


def test_pre_forward_ops_run_in_order_inside_the_batch_time(monkeypatch):
    """A batch's pre-forward ops (`forward_worker.pre_forward_ops`: a host tier's copies, then the tree's
    state copies) run in their order before its forward and count in `busy_seconds` (the host copies ran
    in a test hook outside it before). Here each batch gets a first op that sleeps 50 ms and a last one."""
    real, ran = scheduler_module.pre_forward_ops, []

    def ops(batch, tree_cache, mamba_pool):
        first = lambda: (ran.append("first"), time.sleep(0.05))  # noqa: E731
        return [first, *real(batch, tree_cache, mamba_pool), lambda: ran.append("last")]

    monkeypatch.setattr(scheduler_module, "pre_forward_ops", ops)
    h = SchedulerHarness(PRESET, disable_overlap_schedule=True)
    try:
        h.generate(token_ids(20, seed=5), max_new_tokens=3)
        batches = h.sched.num_batches
        assert batches >= 3 and ran == ["first", "last"] * batches, ran
        assert h.sched.worker.busy_seconds >= 0.05 * batches
    finally:
        h.shutdown()
