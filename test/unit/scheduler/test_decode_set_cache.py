"""Which running requests decode at a step (`DecodeSetCache`): the selection equals the fresh pass over
the running requests at every decode build, through arrivals, finishes by length, by stop token and by
the context length, aborts and retractions, with and without overlap; a request is read in full when it
first qualifies and when its certificate runs out, and a steady decode reuses the previous selection."""

from __future__ import annotations

import pytest

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.decode_set import DecodeSetCache, select_decode_reqs
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, churn_harness, run_churn, token_ids

register_cpu_ci(est_time=12, suite="per-commit-cpu")


def _checked(h: SchedulerHarness) -> dict[str, int]:
    """Check every selection against the fresh pass; count builds, the selected rows, the builds that
    reused the previous selection, and the requests read in full."""
    cache, seen = h.sched.decode_set, {"builds": 0, "rows": 0, "reused": 0, "full_reads": 0}
    select, qualifies = cache.select, cache._qualifies

    def checked_select(running, before_read=None):
        before = cache._reqs
        got = select(running, before_read)
        # The fresh pass reads the lists: the steps the decode logs hold go in first (the selection
        # above flushed only if it read them; the next build's still finds the step processed since).
        h.sched.fast_path.flush()
        fresh = select_decode_reqs(running, cache.context_len, cache.prefill_server)
        assert [r.rid for r in got] == [r.rid for r in fresh]
        seen["builds"] += 1
        seen["rows"] += len(got)
        seen["reused"] += cache._reqs is before and bool(got)
        return got

    def counted_qualifies(req, now):
        seen["full_reads"] += 1
        return qualifies(req, now)

    cache.select, cache._qualifies = checked_select, counted_qualifies
    return seen


@pytest.mark.parametrize("overlap", [True, False])
def test_selection_equals_the_fresh_pass_through_arrivals_finishes_aborts_and_retractions(overlap):
    # context_length: some requests reach the context before their max_new_tokens
    h = churn_harness(overlap, context_length=120)
    seen = _checked(h)
    try:
        rids = run_churn(h, max_steps=400)
        reasons = [h.outputs[r].finished_reason["type"] for r in rids]
        assert h.sched.counters["num_retractions_total"] > 0
        assert {"length", "stop", "abort"} <= set(reasons)
        assert any(len(h.outputs[r].output_ids) < 20 + 9 * k for k, r in enumerate(rids) if k != 5)
        # The last prompt (101 tokens, 137 new asked) ends at the context length.
        assert len(h.outputs[rids[13]].output_ids) == 120 - 101 < 20 + 9 * 13
        assert seen["builds"] > 60 and seen["reused"] > 20
        # Each request is read in full when it first qualifies, again after a retraction, and at the
        # end of its certificate (once or twice): far fewer reads than selected rows.
        assert seen["full_reads"] < seen["rows"] / 4, seen
        assert h.sched.decode_set._reqs == []  # nothing decodes any more: the requests are let go
    finally:
        h.shutdown()


def test_a_request_is_read_once_until_its_certificate_runs_out():
    h = SchedulerHarness("tiny-qwen3-next", disable_overlap_schedule=True)
    try:
        for k, n in enumerate([6, 9]):
            h.submit(token_ids(12, seed=k), max_new_tokens=n, return_logprob=False)
        sched = h.sched
        assert sched.step()  # both prefill: one token each
        cache: DecodeSetCache = sched.decode_set
        reads = []
        qualifies = cache._qualifies

        def counted(req, now):
            reads.append((req.rid, now))
            return qualifies(req, now)

        cache._qualifies = counted
        first = None
        while sched.step():
            first = first or {r.rid: r.decode_until for r in sched.running}
        # Build 0 reads both: 5 more tokens for the first (builds 0-4), 8 for the second (0-7).
        assert first == {"req-0": 5, "req-1": 8}
        # Builds 1-4 reuse the selection; build 5 reads nobody in full either (the first request
        # finished and left); the second finishes at build 7's result, before its certificate runs out
        # at build 8 (no overlap), so it is not read again.
        assert reads == [("req-0", 0), ("req-1", 0)]
        h.collect()
        assert sorted(len(o.output_ids) for o in h.outputs.values()) == [6, 9]
    finally:
        h.shutdown()


def test_a_retracted_request_is_read_again_after_its_new_prefill():
    """Retracted between two builds (pause_generation's retract mode), a request prefills again and its
    prefill samples a token outside any decode batch: it is read in full again, so it is not kept in
    the selection one build past its last token (under overlap, where that build comes before its
    finish is processed)."""
    h = SchedulerHarness("tiny-qwen3-next", mamba_scheduler_strategy="extra_buffer_lazy")
    seen = _checked(h)
    try:
        rid = h.submit(token_ids(12, seed=3), max_new_tokens=10, return_logprob=False)
        for _ in range(4):
            assert h.sched.step()
        h.sched.retract_all()
        assert h.sched.waiting_queue and not h.sched.running
        h.sched.run_until_idle()
        h.collect()
        assert len(h.outputs[rid].output_ids) == 10 and seen["builds"] >= 9
    finally:
        h.shutdown()


def test_requests_compare_by_identity():
    """The scheduler compares lists of requests (`DecodeSetCache`, `DecodeRowsCache`, the waiting queue's
    admitted head) and keeps sets of them: two requests with the same contents are different requests."""
    a, b = (Req("r", [1, 2, 3], SamplingParams()) for _ in range(2))
    assert a != b and [a] != [b] and len({a, b}) == 2 and [a] == [a]
