"""The decode side's ordering rule, without servers: a reservation's destination goes to the prefill
server only once every batch launched before the reservation is processed. Under the overlap schedule
the batch launched after batch N may still write the slots a request finished in N gave back; the
forward stream orders that write before later forwards, but nothing orders it against a transfer."""

from __future__ import annotations

from types import SimpleNamespace

from sglang.srt.managers.io_struct import BootstrapInfo
from sglang.srt.managers.schedule_batch import Req
from sglang.test.ci_register import register_cpu_ci
from sglang.test.pd_fakes import decode_queue

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def req(room: str) -> Req:
    r = Req(f"rid-{room}", [5, 6, 7])
    r.bootstrap = BootstrapInfo("127.0.0.1", 8998, room)
    r.kv_indices, r.mamba_pool_idx = [10, 11, 12], 3
    return r


def test_a_destination_waits_for_the_batches_launched_before_its_reservation():
    sched = SimpleNamespace(processed_batch_id=6, num_batches=7)
    q = decode_queue(sched)
    a = req("a")
    q.reserved.append((a, sched.num_batches, 0))  # reserved while batch 7 is in flight
    assert not q._send_destinations()
    assert q.channel.sent == [] and q.transfers == {}
    sched.processed_batch_id = 7
    assert q._send_destinations()
    [(url, msg)] = q.channel.sent
    assert url == "tcp://127.0.0.1:8998"
    assert (msg["type"], msg["room"], msg["kv"], msg["slot"]) == ("dst", "a", [10, 11, 12], 3)
    assert "a" in q.transfers and "a" in q.dst_sent


def test_a_request_refused_before_its_destination_went_out_cancels_its_room():
    q = decode_queue(SimpleNamespace(processed_batch_id=0, num_batches=0))
    r = req("b")
    r.finished_reason = {"type": "abort", "message": "refused"}
    q.on_released(r)
    assert q.channel.sent == [
        ("tcp://127.0.0.1:8998", {"type": "cancel", "room": "b", "notify": q.notify_url})
    ]
    # Once the destination went out, the prefill server answers by itself: no cancel.
    q.channel.sent.clear()
    q.dst_sent.add("b")
    q.on_released(r)
    assert q.channel.sent == []


def test_a_malformed_done_answer_aborts_its_request_instead_of_orphaning_it():
    """Review finding 1: a "done" whose fields do not parse left its request in no queue, never released
    (its slots and staging range leaked, its client waited forever). Every field is read before anything
    is committed; a malformed answer fails the request with a 500, whose release frees what it holds."""
    aborted = []
    sched = SimpleNamespace(abort_with_status=lambda reqs, msg, code, *a: aborted.append((reqs, msg, code)),
                            counters={"num_generation_tokens_total": 0})  # fmt: skip
    q = decode_queue(sched)
    for room, bad in [("a", {"output_ids": ["not-a-token"]}), ("b", {"output_ids": [1], "bytes": "x"}),
                      ("c", {"output_ids": [1], "output_token_logprobs": [[0.5]]})]:  # fmt: skip
        r = req(room)
        r.sampling_params.max_new_tokens = 8
        r.return_logprob = True
        q.transfers[room] = (r, 0.0)
        arrived = []
        q._on_done({"type": "done", "room": room, "ok": True, **bad}, arrived)
        assert arrived == []
        assert aborted[-1][0] == [r] and aborted[-1][2] == 500 and "malformed answer" in aborted[-1][1]
        assert r.output_ids == [] and room not in q.transfers
    assert q.stats["failed_transfers"] == 3 and q.stats["transfers"] == 0
