"""`DecodeKVLog` (decode slots appended to the requests' plain `kv_indices` lists at the boundaries that
read them): any interleaving of steps, one request's flush, a full flush, a replacement of a list (after
the set is forgotten, as a release does) and changes of the decode set leaves every flushed list equal to
appending each step at once; in the scheduler, through churn, aborts and retractions with and without
overlap, every decode build's lengths and new slots equal the lists once flushed, which do lag behind in
steady steps (the point of the log)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.decode_kv_log import DecodeKVLog
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import churn_harness, run_churn

register_cpu_ci(est_time=20, suite="per-commit-cpu")


def _reqs(n: int) -> list[Req]:
    reqs = [Req(f"r{i}", [1, 2, 3]) for i in range(n)]
    for i, r in enumerate(reqs):
        r.kv_indices = [1000 * i + j for j in range(3 + i)]
    return reqs


# One operation: ("step",), ("flush",), ("read", k), ("replace", k) or ("set", mask): a step of the
# current decode set; a flush of every list; a flush and read of request k's list alone (k indexes all
# requests, in the set or not); a replacement of it (as a release or a retraction does, after forgetting
# the set); a new decode set (the requests `mask` keeps, in order).
_ops = st.lists(
    st.one_of(
        st.just(("step",)),
        st.just(("flush",)),
        st.tuples(st.just("read"), st.integers(0, 5)),
        st.tuples(st.just("replace"), st.integers(0, 5)),
        st.tuples(st.just("set"), st.lists(st.booleans(), min_size=6, max_size=6)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=_ops, max_pending=st.sampled_from([2, 64]), scans=st.sampled_from([0, 16]))
def test_any_interleaving_equals_appending_at_once(ops, max_pending, scans):
    log = DecodeKVLog()
    log.MAX_PENDING, log.SCANS = max_pending, scans  # small: the bound and the map of places both used
    reqs = _reqs(6)
    model = {id(r): list(r.kv_indices) for r in reqs}  # what appending at once gives
    members = reqs[:4]
    fresh = iter(range(10**6, 2 * 10**6))
    for op in ops:
        if op[0] == "step":
            slots = [next(fresh) for _ in members]
            after = log.record(members, slots)
            for r, s in zip(members, slots, strict=True):
                model[id(r)].append(s)
            assert after == [len(model[id(r)]) for r in members]
        elif op[0] == "flush":
            log.flush()
            assert not log.pending
        elif op[0] == "read":
            r = reqs[op[1]]
            log.flush(r)
            assert r.kv_indices == model[id(r)]
        elif op[0] == "replace":
            r = reqs[op[1]]
            log.clear()  # slots pending for the old list go to the old list
            r.kv_indices = [-1, -2]
            model[id(r)] = [-1, -2]
        else:
            members = [r for r, keep in zip(reqs, op[1], strict=True) if keep]
        log.check()
    assert len(log.pending) <= max_pending
    log.flush()
    for r in reqs:
        assert r.kv_indices == model[id(r)]


def test_steady_steps_leave_the_lists_alone_until_read():
    log, reqs = DecodeKVLog(), _reqs(3)
    before = [list(r.kv_indices) for r in reqs]
    assert log.record(reqs, [0, 1, 2]) == [len(b) + 1 for b in before]  # a new set: appended at once
    assert [r.kv_indices for r in reqs] == [b + [i] for i, b in enumerate(before)] and not log.pending
    before = [list(r.kv_indices) for r in reqs]
    for step in range(1, 5):
        assert log.record(reqs, [10 * step + i for i in range(3)]) == [len(b) + step for b in before]
    assert [r.kv_indices for r in reqs] == before and len(log.pending) == 4  # reading changes nothing
    log.flush(reqs[1])  # one request's boundary appends its own
    assert reqs[1].kv_indices == before[1] + [11, 21, 31, 41]
    assert reqs[0].kv_indices == before[0] and reqs[2].kv_indices == before[2]
    log.record(reqs[:2], [7, 8])  # another decode set: everything pending goes in first
    assert not log.pending
    assert reqs[0].kv_indices == before[0] + [10, 20, 30, 40, 7]
    assert reqs[1].kv_indices == before[1] + [11, 21, 31, 41, 8]
    assert reqs[2].kv_indices == before[2] + [12, 22, 32, 42]


def test_the_check_catches_a_list_whose_length_changed_in_place():
    log, reqs = DecodeKVLog(), _reqs(3)
    for step in range(3):
        log.record(reqs, [10 * step + i for i in range(3)])
    log.check()
    log.flush(reqs[2])
    log.check()
    reqs[1].kv_indices.append(99)  # in place: the next step would start from a wrong length
    with pytest.raises(AssertionError, match="differ"):
        log.check()


def test_a_step_must_give_every_request_a_slot():
    log, reqs = DecodeKVLog(), _reqs(2)
    with pytest.raises(AssertionError, match="one per request"):
        log.record(reqs, [5])


def _checked(h) -> dict[str, int]:
    """At every decode build: its KV lengths and new slots against the lists, flushed (at every other
    build and for every other request, so that one request's flush and full flushes both happen)."""
    sched, seen = h.sched, {"builds": 0, "lagging": 0}
    build = sched.get_new_batch_decode

    def checked():
        batch = build()
        if batch is not None:
            fb, reqs = batch.forward_batch, batch.reqs
            seen["builds"] += 1
            seen["lagging"] += any(len(r.kv_indices) < n for r, n in zip(reqs, fb.seq_lens_cpu, strict=True))
            if seen["builds"] % 2:
                for i in range(0, len(reqs), 2):
                    sched.fast_path.flush(reqs[i])
                    assert len(reqs[i].kv_indices) == fb.seq_lens_cpu[i]
                    assert reqs[i].kv_indices[-1] == fb.out_cache_loc[i].item()
        return batch

    sched.get_new_batch_decode = checked
    return seen


@pytest.mark.parametrize("overlap", [True, False])
def test_decode_builds_equal_a_fresh_reading_through_churn_aborts_and_retractions(overlap):
    h = churn_harness(overlap)
    seen = _checked(h)
    try:
        run_churn(h)
        assert h.sched.counters["num_retractions_total"] > 0
        assert seen["builds"] > 60 and seen["lagging"] > 20
        h.sched.check_integrity()  # every page held or free exactly once, lists against the tree
    finally:
        h.shutdown()
