"""`DecodeTokenLog`: decode steps on which no request can finish only log their tokens. Serving with the
log gives exactly the outputs of committing every token at once, through finishes by length, stop token
and context length, an abort and retractions, with and without overlap; a request's `output_ids` lacks
the pending steps until a boundary commits them; steps that could end a request are committed one by
one."""

from __future__ import annotations

import pytest

from sglang.srt.managers.scheduler_components.decode_token_log import DecodeTokenLog
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, churn_harness, run_churn, token_ids

register_cpu_ci(est_time=20, suite="per-commit-cpu")


def _outputs(h: SchedulerHarness, rids: list[str]) -> list[tuple[list[int], dict]]:
    return [(h.outputs[r].output_ids, h.outputs[r].finished_reason) for r in rids]


@pytest.mark.parametrize("overlap", [True, False])
def test_churn_serves_the_same_outputs_with_and_without_the_log(overlap, monkeypatch):
    h = churn_harness(overlap, context_length=120)
    try:
        rids = run_churn(h, max_steps=400)
        logged = h.sched.result_processor.token_log.steps_logged
        retractions = h.sched.counters["num_retractions_total"]
        with_log = _outputs(h, rids)
        h.flush_and_check_empty()
    finally:
        h.shutdown()
    assert logged > 20, "the workload must log steps"
    assert retractions > 0
    assert {r["type"] for _, r in with_log} == {"length", "stop", "abort"}
    assert len(with_log[13][0]) == 120 - 101, "the last request ends at the context length"

    monkeypatch.setattr(DecodeTokenLog, "log", lambda self, reqs, tokens: False)
    h = churn_harness(overlap, context_length=120)
    try:
        rids = run_churn(h, max_steps=400)
        assert h.sched.result_processor.token_log.steps_logged == 0
        assert _outputs(h, rids) == with_log
    finally:
        h.shutdown()


def test_the_lists_wait_for_a_boundary_between_logged_steps():
    """`output_ids` is a plain list: between logged steps it lacks their tokens (nothing reads it), the
    invariants count them, and a boundary (here the integrity check) commits them; a request that leaves
    the running set without its boundary's flush fails the integrity check's guard."""
    h = SchedulerHarness("tiny-qwen3-next", disable_overlap_schedule=True)
    try:
        rids = [h.submit(token_ids(12, seed=k), max_new_tokens=90, return_logprob=False) for k in range(3)]
        sched, log = h.sched, h.sched.result_processor.token_log
        steps = 0
        while len(log.pending) < 10:
            assert sched.step()
            steps += 1
        reqs = list(sched.running)
        # One token from the prefill, then one per decode step.
        assert all(len(r.output_ids) == steps - 10 for r in reqs)
        sched.fast_path.check(sched.running)  # the lengths add up with the steps pending
        sched.check_integrity()
        assert not log.pending and [len(r.output_ids) for r in reqs] == [steps] * 3
        while len(log.pending) < 3:
            assert sched.step()
        reqs[1].output_ids.append(5)  # a token from outside the set's steps breaks the invariant
        with pytest.raises(AssertionError, match="decode output lengths"):
            log.check()
        reqs[1].output_ids.pop()
        sched.running.remove(reqs[2])  # gone without the flush its way out does
        with pytest.raises(AssertionError, match="no longer running"):
            sched.fast_path.check(sched.running)
        sched.running.append(reqs[2])
        # 90 tokens: past MAX_PENDING (64) logged steps, then the length finish at the slack's end.
        sched.run_until_idle()
        h.collect()
        assert log.steps_logged > DecodeTokenLog.MAX_PENDING
        assert [len(h.outputs[r].output_ids) for r in rids] == [90] * 3
        assert all(h.outputs[r].finished_reason == {"type": "length", "length": 90} for r in rids)
    finally:
        h.shutdown()


def test_a_stop_token_of_any_request_commits_that_step_one_by_one():
    """The step whose tokens hold a stop id of the set is committed one by one: the request it ends
    finishes on it, the others go on."""
    h = SchedulerHarness("tiny-qwen3-next", disable_overlap_schedule=True)
    try:
        prompt = token_ids(12, seed=7)
        ref = h.generate(prompt, max_new_tokens=40, return_logprob=False).output_ids
        m = next(i for i in range(8, 40) if ref[i] not in ref[:i])  # first seen after logging starts
        other = h.submit(token_ids(12, seed=8), max_new_tokens=40, return_logprob=False)
        stopped = h.submit(prompt, max_new_tokens=40, return_logprob=False, stop_token_ids=[ref[m]])
        h.run()
        assert h.outputs[stopped].output_ids == ref[: m + 1]
        assert h.outputs[stopped].finished_reason == {"type": "stop", "matched": ref[m]}
        assert len(h.outputs[other].output_ids) == 40
        assert h.sched.result_processor.token_log.steps_logged > 0
    finally:
        h.shutdown()


def test_an_abort_between_logged_steps_sends_the_tokens_sampled_before_it():
    h = SchedulerHarness("tiny-qwen3-next")  # overlap: a batch with the request is in flight
    try:
        ref = h.generate(token_ids(12, seed=9), max_new_tokens=60, return_logprob=False).output_ids
        rid = h.submit(token_ids(12, seed=9), max_new_tokens=60, return_logprob=False)
        keep = h.submit(token_ids(12, seed=10), max_new_tokens=60, return_logprob=False)
        log = h.sched.result_processor.token_log
        while len(log.pending) < 5:
            assert h.sched.step()
        h.sched.abort_request(rid)
        assert not log.pending, "an abort forgets the set, its tokens appended"
        h.run()
        out = h.outputs[rid]
        assert out.finished_reason["type"] == "abort"
        assert 5 < len(out.output_ids) < 60 and out.output_ids == ref[: len(out.output_ids)]
        assert len(h.outputs[keep].output_ids) == 60
    finally:
        h.shutdown()
