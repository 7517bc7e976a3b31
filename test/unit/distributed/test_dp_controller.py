"""The data-parallel controller's matching of the replicas' messages (review findings 5 and 6), without
processes: a heartbeat goes on only once every replica has beaten since the last one forwarded (one
healthy replica must not hide a stalled one from backend_health), and a control call's reply is
merged from each replica's reply to that call, a late reply to a call the tokenizer gave up on being
dropped rather than merged into the next call's."""

from __future__ import annotations

from sglang.srt.managers.data_parallel_controller import FromReplica, ReplyMatcher, reply_type_name
from sglang.srt.managers.io_struct import (
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerHeartbeat,
)
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def test_a_heartbeat_goes_on_once_every_replica_has_beaten():
    m = ReplyMatcher(2)
    beat = SchedulerHeartbeat()
    assert m.received(FromReplica(0, beat)) is None
    assert m.received(FromReplica(0, beat)) is None  # (replica 1 stalled: replica 0 alone is not enough)
    assert m.received(FromReplica(1, beat)) is beat
    assert m.received(FromReplica(1, beat)) is None


def test_a_late_reply_is_dropped_not_merged_into_the_next_call():
    m = ReplyMatcher(2)
    ok, late, busy = (
        FlushCacheReqOutput(True, "1"),
        FlushCacheReqOutput(True, "late"),
        FlushCacheReqOutput(False, "busy"),
    )
    m.sent(FlushCacheReqInput())
    assert m.received(FromReplica(0, ok)) is None
    # The tokenizer gave up on call 1 (replica 1 slower than CONTROL_TIMEOUT_S) and sends call 2.
    m.sent(FlushCacheReqInput())
    assert m.received(FromReplica(0, busy)) is None  # (replica 0's answer to call 2: not yet all)
    assert m.received(FromReplica(1, late)) is None  # (call 1 complete, but stale: dropped)
    second = FlushCacheReqOutput(True, "2")
    assert m.received(FromReplica(1, second)) is busy  # (call 2's replies only: replica 0's failure)


def test_reply_types_follow_io_struct_names():
    assert reply_type_name(FlushCacheReqInput()) == FlushCacheReqOutput.__name__
    assert reply_type_name(GetInternalStateReq()) == GetInternalStateReqOutput.__name__
