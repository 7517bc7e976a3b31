"""Priority scheduling's rule without a server (`priority_scheduling.py`, upstream's
--enable-priority-scheduling): the waiting order, who may preempt whom, which request a full queue
refuses, and the start-time checks. What it does on a server: test_priority_scheduling_server.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.managers.scheduler_components.priority_scheduling import (
    PriorityRule,
    preemption_victims,
    queue_overflow,
)
from sglang.srt.server_args import ServerArgsError, prepare_server_args
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def req(name: str, priority: int | None, created: float = 0.0):
    return SimpleNamespace(rid=name, priority=priority, created_time=created)


def names(reqs) -> list[str]:
    return [r.rid for r in reqs]


def test_higher_values_first_then_the_policy_order_and_none_last():
    queue = [req("a", 1), req("b", None), req("c", 5), req("d", 1), req("e", -3)]
    assert names(PriorityRule().order(queue)) == ["c", "a", "d", "e", "b"]
    assert names(PriorityRule(low_values_first=True).order(queue)) == ["e", "a", "d", "c", "b"]
    # --default-priority-value: a request without one takes it.
    assert names(PriorityRule(default=3).order(queue)) == ["c", "b", "a", "d", "e"]


def test_preemption_needs_more_than_the_threshold_and_no_room():
    rule = PriorityRule(threshold=10)
    running = [req("r0", 0, 1.0), req("r5", 5, 2.0), req("rn", None, 3.0), req("r0b", 0, 4.0)]
    best, victims = preemption_victims(rule, [req("w", 11)], running, lambda r: True)
    # 11 outranks 0 and none by more than 10, not 5; least preferred first, the newest among equals.
    assert best.rid == "w" and names(victims) == ["rn", "r0b", "r0"]
    assert names(preemption_victims(rule, [req("w", 10)], running, lambda r: True)[1]) == ["rn"]  # (10 - 0: not)
    assert preemption_victims(rule, [req("w", 99)], running, lambda r: False) == (None, [])  # (room: none)
    assert preemption_victims(None, [req("w", 99)], running, lambda r: True) == (None, [])  # (disabled)
    no_preempt = PriorityRule(preemption=False)
    assert preemption_victims(no_preempt, [req("w", 99)], running, lambda r: True) == (None, [])
    # Equal priorities never preempt each other, whatever the threshold (0 is the least allowed).
    assert preemption_victims(PriorityRule(threshold=0), [req("w", 5)], [req("r", 5)], lambda r: True)[1] == []

    # With nobody to preempt the room is not looked at (a radix match of the waiting prompt, every step).
    def no_look(r):
        raise AssertionError("the room was looked at")

    assert preemption_victims(rule, [req("w", 5)], [req("r", 0)], no_look) == (None, [])


def test_a_full_queue_refuses_the_newcomer_or_the_least_preferred_waiting_one_it_outranks():
    waiting = [req("a", 5), req("b", 1), req("c", 1)]
    new = req("n", 3)
    assert queue_overflow(None, PriorityRule(), waiting, new) is None  # (no bound)
    assert queue_overflow(4, PriorityRule(), waiting, new) is None  # (room)
    assert queue_overflow(3, None, waiting, new) is new  # (without priority: the newcomer, as upstream)
    assert queue_overflow(3, PriorityRule(), waiting, new).rid == "c"  # (the newest of the least preferred)
    assert queue_overflow(3, PriorityRule(), waiting, req("m", 1)).rid == "m"  # (not preferred to them)


@pytest.mark.parametrize(
    "flags, sentence",
    [
        (["--enable-priority-scheduling", "--schedule-policy", "lpm"],
         "--enable-priority-scheduling orders within --schedule-policy fcfs or lof"),
        (["--enable-priority-scheduling", "--priority-scheduling-preemption-threshold", "-1"],
         "--priority-scheduling-preemption-threshold must be at least 0"),
        (["--enable-priority-scheduling", "--default-priority-value", str(1 << 62)],
         "--default-priority-value must be within +-2**62."),
    ],
)  # fmt: skip
def test_wrong_flags_are_refused_in_one_sentence(flags, sentence):
    with pytest.raises(ServerArgsError) as e:
        prepare_server_args(["--model-path", "tiny-qwen3-next", *flags])
    assert str(e.value).startswith(sentence), str(e.value)


def test_the_rule_follows_the_flags_and_pd_never_preempts():
    args = prepare_server_args(["--model-path", "tiny-qwen3-next", "--enable-priority-scheduling",
                                "--schedule-low-priority-values-first", "--default-priority-value", "7",
                                "--priority-scheduling-preemption-threshold", "3"])  # fmt: skip
    assert PriorityRule.of(args) == PriorityRule(True, 7, 3, True)
    assert PriorityRule.of(prepare_server_args(["--model-path", "tiny-qwen3-next"])) is None
    pd = prepare_server_args(["--model-path", "tiny-qwen3-next", "--enable-priority-scheduling",
                              "--disaggregation-mode", "decode"])  # fmt: skip
    assert PriorityRule.of(pd).preemption is False


def harness_with(**kw):
    from sglang.test.scheduler_harness import SchedulerHarness

    return SchedulerHarness("tiny-qwen3-next", enable_priority_scheduling=True, max_total_tokens=400,
                            max_running_requests=4, **kw)  # fmt: skip


def submit(h, ids: list[int], tokens: int, priority: int) -> str:
    rid = h.submit(ids, tokens, return_logprob=False)
    h.sched.reqs_by_rid[rid].priority = priority
    return rid


def test_no_preemption_where_the_cached_prefix_leaves_room_or_the_victims_cannot_make_it():
    """Review of 3844fee (findings 1, 2), in a scheduler with a 400-token KV pool: a newcomer that shares
    a running request's 256-token prompt needs KV for its 8 new tokens only (it preempted that request);
    and one whose 200 tokens the request it outranks (20 of them) cannot free is not helped by retracting
    it (it was retracted, then idle until the preferred one it could not outrank finished)."""
    from sglang.test.scheduler_harness import token_ids

    h = harness_with()
    try:
        shared = token_ids(256, 1)
        submit(h, shared, 40, 0)
        for _ in range(4):
            h.sched.step()
        newcomer = submit(h, shared + token_ids(8, 2), 4, 50)
        h.sched.step()
        assert h.sched.counters["num_preemptions_total"] == 0
        assert newcomer in [r.rid for r in h.sched.running]
        h.run()
    finally:
        h.shutdown()
    h = harness_with(chunked_prefill_size=-1)
    try:
        submit(h, token_ids(250, 1), 60, 100)
        small = submit(h, token_ids(20, 2), 60, 0)
        for _ in range(4):
            h.sched.step()
        submit(h, token_ids(200, 3), 4, 50)
        h.sched.step()
        assert h.sched.counters["num_preemptions_total"] == 0
        assert small in [r.rid for r in h.sched.running]
        h.run()
        assert all(o.finished_reason["type"] == "length" for o in h.outputs.values())
    finally:
        h.shutdown()
