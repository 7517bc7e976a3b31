"""What is in flight for each request (`InflightBatches`): a decode build's input tokens, including the
two shortcuts (the placeholders of the previous decode of the same requests under overlap, the tokens of
the last processed decode without it), and each request's batch and token counts, equal at every build
to a fresh reading of the batches the scheduler has launched and not processed, through arrivals,
finishes, aborts and retractions, with and without overlap; and the ledger's own rules on small cases."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.inflight_batches import (
    FutureSlots,
    InflightBatches,
    placeholders,
)
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, churn_harness, run_churn, token_ids

register_cpu_ci(est_time=15, suite="per-commit-cpu")


def _fresh(sched, reqs: list[Req]) -> tuple[list[int], list[int], list[int]]:
    """From the scheduler's launched batches, oldest first: each request's input token (the newest
    placeholder of a batch that samples it, else its newest output), batches and tokens in flight."""
    refs, batches, tokens = {}, {}, {}
    for batch, _ in sched.in_flight:
        for req, slot, sampled in zip(batch.reqs, batch.future_slots, batch.sample_rows, strict=True):
            batches[req] = batches.get(req, 0) + 1
            if sampled:
                refs[req] = -(slot + 1)
                tokens[req] = tokens.get(req, 0) + 1
    ids = [refs[r] if r in refs else _newest_output(sched, r) for r in reqs]
    return ids, [batches.get(r, 0) for r in reqs], [tokens.get(r, 0) for r in reqs]


def _newest_output(sched, req: Req) -> int:
    """`req`'s newest token: its list's last, or the newest step the decode token log holds for it (the
    list lacks those until a boundary commits them)."""
    log = sched.fast_path.token_log
    place = next((i for i, r in enumerate(log._reqs) if r is req), None)
    if place is not None and log.lacking()[place]:
        return log.pending[-1][place]
    return req.output_ids[-1]


def _checked(h: SchedulerHarness) -> dict[str, int]:
    """Check every decode build's input ids and every request's counts against `_fresh`; count the
    builds by the path that answered them."""
    sched, seen = h.sched, {"builds": 0, "overlap_steady": 0, "landed": 0, "placeholders": 0}
    inflight = sched.inflight
    decode_input_ids, steady_decode_input_ids = inflight.decode_input_ids, inflight.steady_decode_input_ids

    def checked_steady(reqs):
        landed = inflight._landed
        out = steady_decode_input_ids(reqs)
        return out if out is None else check(reqs, out, landed)

    def checked(reqs):
        landed = inflight._landed
        return check(reqs, decode_input_ids(reqs), landed)

    def check(reqs, out, landed):
        ids, has_placeholders = out
        want, batches, tokens = _fresh(sched, reqs)
        assert list(ids) == want
        assert has_placeholders == (min(want) < 0)
        assert [r.num_inflight for r in reqs] == batches
        assert [r.inflight_tokens for r in reqs] == tokens
        seen["builds"] += 1
        seen["overlap_steady"] += isinstance(ids, range)
        seen["landed"] += landed is not None and ids is landed[1]
        seen["placeholders"] += has_placeholders
        return ids, has_placeholders

    inflight.decode_input_ids, inflight.steady_decode_input_ids = checked, checked_steady
    return seen


@pytest.mark.parametrize("overlap", [True, False])
def test_input_ids_and_counts_equal_a_fresh_reading_through_churn_aborts_and_retractions(overlap):
    h = churn_harness(overlap)  # requests cross 64 and 128: decode snapshots too
    seen = _checked(h)
    try:
        run_churn(h)
        assert h.sched.counters["num_retractions_total"] > 0
        assert len(h.sched.inflight) == 0 and all(r.num_inflight == 0 for r in h.sched.running)
        assert seen["builds"] > 60
        if overlap:
            assert seen["overlap_steady"] > 20 and seen["placeholders"] == seen["builds"]
            assert seen["landed"] == 0
        else:
            assert seen["landed"] > 20 and seen["placeholders"] == 0
    finally:
        h.shutdown()


def test_outputs_are_the_same_with_and_without_overlap():
    """The shortcuts change where a decode's input token comes from, never which token it is."""
    outputs = []
    for overlap in (True, False):
        h = SchedulerHarness("tiny-qwen3-next", disable_overlap_schedule=not overlap, max_running_requests=4)
        try:
            rids = [h.submit(token_ids(9 + k, seed=k), max_new_tokens=6 + 3 * k) for k in range(6)]
            h.sched.run_until_idle()
            h.collect()
            outputs.append([h.outputs[r].output_ids for r in rids])
        finally:
            h.shutdown()
    assert outputs[0] == outputs[1]
    assert [len(o) for o in outputs[0]] == [6 + 3 * k for k in range(6)]


def _req(i: int, *outputs: int) -> Req:
    req = Req(f"r{i}", [1, 2], SamplingParams())
    req.output_ids = list(outputs)
    return req


def _batch(reqs: list[Req], mode: ForwardMode = ForwardMode.DECODE, sample_rows=None) -> SimpleNamespace:
    rows = [True] * len(reqs) if sample_rows is None else sample_rows
    return SimpleNamespace(reqs=reqs, batch_size=len(reqs), forward_mode=mode, sample_rows=rows)


def test_placeholders_name_the_newest_sampling_batch_of_each_request():
    a, b, c = _req(0, 7), _req(1, 8), _req(2, 9)
    inflight = InflightBatches(future_size=5)
    for r in (a, b, c):
        r.inflight = inflight
    extend = _batch([a, b], ForwardMode.EXTEND, sample_rows=[True, False])  # b's prefill goes on
    inflight.add(extend)
    assert extend.future_slots == range(0, 2)
    assert inflight.decode_input_ids([a, c]) == ([-1, 9], True)
    decode = _batch([a, c])
    inflight.add(decode)  # slots 2, 3
    assert inflight.decode_input_ids([c, a, b]) == ([-4, -3, 8], True)
    assert (a.num_inflight, a.inflight_tokens, b.num_inflight, b.inflight_tokens) == (2, 2, 1, 0)
    # The same requests in the same order as the newest batch: its placeholders, as a range.
    ids, has = inflight.decode_input_ids([a, c])
    assert ids == range(-3, -5, -1) and list(ids) == [-3, -4] and has
    wrapped = _batch([b, c])
    inflight.add(wrapped)  # slots 4, 0: the ring wraps, a list
    assert wrapped.future_slots == [4, 0]
    assert inflight.decode_input_ids([b, c]) == ([-5, -1], True)
    with pytest.raises(AssertionError, match="order"):
        inflight.landed(decode, [0, 0])
    inflight.landed(extend, [5, 6])
    assert (a.num_inflight, b.num_inflight, c.num_inflight) == (1, 1, 2)


def test_without_batches_in_flight_the_landed_decode_gives_the_tokens():
    a, b = _req(0, 7), _req(1, 8)
    inflight = InflightBatches(future_size=64)
    decode = _batch([a, b])
    inflight.add(decode)
    inflight.landed(decode, [11, 12])
    a.output_ids.append(11)
    b.output_ids.append(12)
    assert inflight.decode_input_ids([a, b]) == ([11, 12], False)
    assert inflight.decode_input_ids([b, a]) == ([12, 11], False)  # another order: read the requests
    extend = _batch([b], ForwardMode.EXTEND)
    inflight.add(extend)
    inflight.landed(extend, [13])  # an extend's tokens are not kept: read the requests
    b.output_ids.append(13)
    assert inflight.decode_input_ids([a, b]) == ([11, 13], False)


def test_future_slots_and_placeholders():
    slots = FutureSlots(4)
    assert slots.alloc(3) == range(0, 3) and slots.alloc(2) == [3, 0] and slots.alloc(1) == range(1, 2)
    assert list(placeholders(range(5, 8))) == [-6, -7, -8] and placeholders([3, 0]) == [-4, -1]
    assert list(placeholders(range(0))) == []
