"""Which running requests decode at a step (`DecodeSetCache`): the cached selection equals the fresh pass
over the running requests at every decode build, through arrivals, finishes by length, by stop token and
by the context length, aborts and retractions, with and without overlap; and a steady decode reuses it."""

from __future__ import annotations

import pytest

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.decode_set import DecodeSetCache, select_decode_reqs
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=12, suite="per-commit-cpu")


def _checked(h: SchedulerHarness) -> dict[str, int]:
    """Check every selection against the fresh pass; count the steps that reused the previous one."""
    cache, seen = h.sched.decode_set, {"builds": 0, "reused": 0}
    select = cache.select

    def checked_select(running):
        before = (list(cache._reqs), cache._steps_left)
        got = select(running)
        fresh = select_decode_reqs(running, cache.context_len, cache.prefill_server)
        assert [r.rid for r in got] == [r.rid for r in fresh]
        seen["builds"] += 1
        seen["reused"] += cache._steps_left is not None and (before[0] == got)
        return got

    cache.select = checked_select
    return seen


@pytest.mark.parametrize("overlap", [True, False])
def test_selection_equals_the_fresh_pass_through_arrivals_finishes_aborts_and_retractions(overlap):
    h = SchedulerHarness(
        "tiny-qwen3-next",
        mamba_scheduler_strategy="extra_buffer_lazy",
        disable_overlap_schedule=not overlap,
        max_running_requests=8,
        max_total_tokens=520,  # too few for everyone's outputs: retractions
        context_length=120,  # some requests reach the context before their max_new_tokens
        mamba_track_interval=64,
    )
    seen = _checked(h)
    try:
        rids = []
        for k in range(14):
            prompt = token_ids(10 + 7 * k, seed=k)
            stops = {"stop_token_ids": list(range(3, 12))} if k % 3 == 0 else {}
            rids.append(h.submit(prompt, max_new_tokens=20 + 9 * k, return_logprob=False, **stops))
        for step in range(400):
            if step == 40:
                h.sched.abort_request(rids[5])  # running by now (or finished): either is fine
            if not h.sched.step():
                break
        h.collect()
        reasons = [h.outputs[r].finished_reason["type"] for r in rids]
        assert h.sched.counters["num_retractions_total"] > 0
        assert {"length", "stop", "abort"} <= set(reasons)
        assert any(len(h.outputs[r].output_ids) < 20 + 9 * k for k, r in enumerate(rids) if k != 5)
        # The last prompt (101 tokens, 137 new asked) ends at the context length.
        assert len(h.outputs[rids[13]].output_ids) == 120 - 101 < 20 + 9 * 13
        assert seen["builds"] > 60 and seen["reused"] > 30  # measured 93 and 74 with overlap
        assert h.sched.decode_set._reqs == []  # nothing decodes any more: the requests are let go
    finally:
        h.shutdown()


def test_a_steady_decode_reuses_the_selection_until_a_request_runs_out_of_tokens():
    h = SchedulerHarness("tiny-qwen3-next", disable_overlap_schedule=True)
    try:
        for k, n in enumerate([6, 9]):
            h.submit(token_ids(12, seed=k), max_new_tokens=n, return_logprob=False)
        sched = h.sched
        assert sched.step()  # both prefill: one token each
        cache: DecodeSetCache = sched.decode_set
        sizes, reused = [], []
        while sched.step():
            if sched.running:
                sizes.append(len(cache._reqs))
                reused.append(cache._steps_left)
        # First decode: a fresh pass; second: the same list again, 4 more steps for the first request
        # (6 tokens: 1 from the prefill, 5 decoded), counted down; then it finishes, the list changes.
        assert sizes[:5] == [2, 2, 2, 2, 2] and reused[:5] == [None, 3, 2, 1, 0]
        assert sizes[5] == 1 and reused[5] is None
        h.collect()
        assert sorted(len(o.output_ids) for o in h.outputs.values()) == [6, 9]
    finally:
        h.shutdown()


def test_requests_compare_by_identity():
    """The scheduler compares lists of requests (`DecodeSetCache`, `DecodeRowsCache`, the waiting queue's
    admitted head) and keeps sets of them: two requests with the same contents are different requests."""
    a, b = (Req("r", [1, 2, 3], SamplingParams()) for _ in range(2))
    assert a != b and [a] != [b] and len({a, b}) == 2 and [a] == [a]
