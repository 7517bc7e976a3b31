"""What an idle scheduler checks: in production the O(1) count identity, once per idle period; the full
walk only with SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE (on in this test suite). Either catches a leak.
Its cost is measured in benchmark/bench_idle_check.py."""

from __future__ import annotations

import pytest

from sglang.srt.environ import envs
from sglang.srt.mem_cache import integrity
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=8, suite="per-commit-cpu")


def _counting(monkeypatch) -> dict[str, int]:
    calls = {"check_integrity": 0, "check_accounting": 0}
    from sglang.srt.managers.scheduler_components import scheduler_lifecycle as sched_mod

    for name in calls:
        real = getattr(integrity, name)

        def wrapped(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(sched_mod, name, wrapped)
    return calls


@pytest.mark.parametrize("strict", [False, True])
def test_idle_runs_one_check_per_idle_period(strict, monkeypatch):
    calls = _counting(monkeypatch)
    with envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.override(strict):
        h = SchedulerHarness("tiny-qwen3-next")
    try:
        h.generate(token_ids(100, seed=1), max_new_tokens=3)
        for _ in range(50):  # the event loop polls an idle scheduler many times a second
            assert not h.sched.step()
        h.generate(token_ids(90, seed=2), max_new_tokens=3)
        expected = {"check_integrity": 2 if strict else 0, "check_accounting": 0 if strict else 2}
        assert calls == expected
    finally:
        h.shutdown()


@pytest.mark.parametrize("strict", [False, True])
def test_flush_checks_as_an_idle_scheduler_does(strict, monkeypatch):
    """A flush ran the full walk even in production: ~0.25 s per /flush_cache with default pools."""
    calls = _counting(monkeypatch)
    with envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.override(strict):
        h = SchedulerHarness("tiny-qwen3-next")
    try:
        h.generate(token_ids(100, seed=4), max_new_tokens=3)
        calls.update(check_integrity=0, check_accounting=0)
        assert h.sched.flush_cache() == (True, "")
        assert calls == {"check_integrity": int(strict), "check_accounting": int(not strict)}
        assert h.sched.tree_cache.total_size() == 0
    finally:
        h.shutdown()


def test_count_check_catches_a_leaked_slot_and_page():
    with envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.override(False):
        h = SchedulerHarness("tiny-qwen3-next")
    try:
        h.generate(token_ids(100, seed=3), max_new_tokens=3)
        sched = h.sched
        sched.on_idle()  # clean
        leaked = sched.req_to_token_pool.mamba_allocator.alloc(1)
        assert leaked is not None
        sched.idle_checked = False
        with pytest.raises(AssertionError, match="Mamba slots leaked"):
            sched.on_idle()
        sched.req_to_token_pool.mamba_allocator.free(leaked)
        pages = sched.token_allocator.alloc_extend(0, 1, 0)
        sched.idle_checked = False
        with pytest.raises(AssertionError, match="KV pages leaked"):
            sched.on_idle()
        sched.token_allocator.free(pages)
        sched.idle_checked = False
        sched.on_idle()
    finally:
        h.shutdown()
