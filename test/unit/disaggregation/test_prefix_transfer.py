"""The prefill side of the decode radix cache (issue 56): a destination that says the decode server holds
the prompt's first `prefix` positions gets a transfer of the rest of the KV and the one state, nothing
more; a destination whose prefix or slots do not fit the prompt, or whose staging does not match this
server's path, is answered with an error and moves nothing."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.disaggregation.destination import malformed_dst
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue, _Room
from sglang.srt.disaggregation.transfer import PoolLayout, TransferError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.pd_fakes import prefill_queue

register_cpu_ci(est_time=5, suite="per-commit-cpu")

# One attention layer's K and V (8 bytes a token), one state tensor (16 bytes a slot).
LAYOUT = PoolLayout([1000, 2000], [800, 800], 8, [5000], [160], [16])


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, *args, **kw):
        self.calls.append(args)

    def submit(self, fn, *args):
        self.calls.append((fn.__name__, *args))
        return SimpleNamespace(done=lambda: False)


def queue() -> PrefillBootstrapQueue:
    q = prefill_queue(SimpleNamespace(abort_with_status=Recorder()))
    q.layout = LAYOUT
    q.executor = Recorder()
    q.channel = SimpleNamespace(send=Recorder())
    return q


def start(q: PrefillBootstrapQueue, prefix: int, kv: list[int], **extra) -> _Room:
    req = SimpleNamespace(origin_input_ids=list(range(10)), kv_indices=list(range(30, 40)), mamba_pool_idx=3,
                          rid="r", finished=False)  # fmt: skip
    dst = {"type": "dst", "room": "7", "notify": "tcp://127.0.0.1:1", "session": "s",
           "layout": LAYOUT.to_dict(), "prefix": prefix, "kv": kv, "slot": 2, **extra}  # fmt: skip
    room = _Room(req=req, dst=dst)
    q.rooms["7"] = room
    q._maybe_start("7", room)
    return room


def test_only_the_positions_past_the_prefix_and_one_state_move():
    q = queue()
    room = start(q, 6, [50, 51, 52, 53])
    [(name, plan, inject, cancelled, _)] = q.executor.calls
    [(session, descriptors)] = plan()  # (built on the transfer thread)
    assert name == "_transfer" and session == "s" and not inject and not cancelled.is_set()
    assert room.kv_tokens == 4
    # K and V: prompt positions 6..9 (slots 36..39) into 50..53, one run each; then the state slot 3 -> 2.
    assert descriptors == [
        (1000 + 36 * 8, 1000 + 50 * 8, 4 * 8),
        (2000 + 36 * 8, 2000 + 50 * 8, 4 * 8),
        (5000 + 3 * 16, 5000 + 2 * 16, 16),
    ]


def failed(q: PrefillBootstrapQueue) -> str:
    assert q.executor.calls == [] and "7" not in q.rooms
    [(_, answer)] = q.channel.send.calls
    assert answer["ok"] is False
    return answer["error"]


def test_a_prefix_or_slot_list_that_does_not_fit_the_prompt_is_an_error():
    q = queue()
    start(q, 10, [])
    assert "holds 10 tokens of a 10-token prompt (at most 9)" in failed(q)
    q = queue()
    start(q, 6, [50, 51, 52])
    assert "reserved 3 KV slots for the 4 tokens of a 10-token prompt past its 6 cached ones" in failed(q)


def test_a_staging_mismatch_is_an_error():
    q = queue()
    start(q, 0, list(range(10)), staging=4096)
    assert "one server stages KV and state through host memory and the other does not" in failed(q)


def test_a_malformed_prefix_or_staging_is_refused():
    base = {"notify": "n", "session": "s", "layout": LAYOUT.to_dict(), "kv": [1], "slot": 0}
    assert malformed_dst(base, 4096) is None
    bads = ({"prefix": -1}, {"prefix": "3"}, {"prefix": True}, {"staging": -5}, {"staging": 1.5}, {"staging_bytes": "9"})
    for bad in bads:
        assert malformed_dst({**base, **bad}, 4096) == (
            "prefix must be a token count, staging an address and staging_bytes a size"
        )


def test_a_paged_decode_server_under_extra_buffer_snapshots_every_page_by_default():
    """Its finished turns keep their last page boundary (docs/disaggregation.md; end to end in
    test_pd_decode_cache_strategies.py): the default --mamba-track-interval is the page size there, and
    only there."""
    from sglang.srt.server_args import prepare_server_args

    def interval(*argv: str) -> int:
        return prepare_server_args(list(argv)).mamba_track_interval

    decode = ["--disaggregation-mode", "decode", "--disaggregation-decode-enable-radix-cache", "--page-size", "16"]
    assert interval(*decode, "--mamba-scheduler-strategy", "extra_buffer") == 16
    assert interval(*decode, "--mamba-scheduler-strategy", "extra_buffer", "--mamba-track-interval", "64") == 64
    usual = interval("--page-size", "16", "--mamba-scheduler-strategy", "extra_buffer")
    assert usual >= 256 and usual % 16 == 0
    assert interval(*decode, "--mamba-scheduler-strategy", "extra_buffer_lazy") == usual
    decode[-1] = "1"
    assert interval(*decode, "--mamba-scheduler-strategy", "extra_buffer") == usual


def test_a_transfer_cancelled_before_it_begins_writes_nothing():
    """Review (a): a transfer queued behind another (one transfer thread) and cancelled by the decode
    server meanwhile wrote into a destination the decode side may have reused since."""
    q = queue()
    start(q, 6, [50, 51, 52, 53])
    [(_, plan, inject, cancelled, _)] = q.executor.calls
    q._on_cancel({"type": "cancel", "room": "7"})
    assert cancelled.is_set()
    q.engine = SimpleNamespace(write=Recorder())
    with pytest.raises(TransferError, match="cancelled by the decode server"):
        q._transfer(plan, inject, cancelled)
    assert q.engine.write.calls == []


def test_a_destination_whose_transfer_cannot_be_built_fails_that_request_only(monkeypatch):
    """Review finding 1 (issue 56): whatever building the transfer raises (a destination `malformed_dst`
    let through) fails that room's transfer at once, as a failed write does (under TP the exchange ends
    it on every rank with this error), instead of raising on the scheduler's thread."""
    import sglang.srt.disaggregation.prefill as prefill

    def raising(*args):
        raise ValueError("zip() argument 2 is shorter than argument 1")

    monkeypatch.setattr(prefill, "rank_writes", raising)
    q = queue()
    start(q, 6, [50, 51, 52, 53])
    # (the writes are built on the transfer thread: tens of ms for a long prompt between TP sizes)
    [(_, plan, inject, cancelled, key)] = q.executor.calls
    q.engine = SimpleNamespace(write=Recorder())
    with pytest.raises(TransferError) as raised:
        q._transfer(plan, inject, cancelled, key)
    assert str(raised.value) == "the destination cannot be written (ValueError)" and q.engine.write.calls == []


def test_an_injected_failure_can_name_one_tp_rank(monkeypatch):
    """Review finding 6 (issue 56): the injection failed every rank alike, so a failure on one rank (the
    others still writing) could not be tested end to end; PREFIX + "rankN-" fails TP rank N's alone."""
    from sglang.srt.disaggregation.prefill import _injected

    monkeypatch.setenv("SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER", "fail-")
    assert _injected("fail-1", 0) and _injected("fail-1", 1) and not _injected("ok-1", 0)
    assert _injected("fail-rank1-x", 1) and not _injected("fail-rank1-x", 0)
    assert _injected("fail-ranking-x", 0)  # (no rank named: every rank's)
    q = queue()  # (TP rank 0)
    start(q, 6, [50, 51, 52, 53])
    q.rooms["7"].req.rid = "fail-rank1-x"
    q.executor.calls, q.rooms["7"].future = [], None
    q._maybe_start("7", q.rooms["7"])
    [(_, _, inject, _, _)] = q.executor.calls
    assert not inject


def test_a_decode_server_of_another_size_than_disaggregation_decode_tp_is_refused_naming_the_flag():
    """--disaggregation-decode-tp (upstream's: the decode servers' --tp-size, given to the prefill server):
    where set, a destination from a decode server of another size fails its request naming the flag;
    the matching size is served."""
    q = queue()
    q.decode_tp = 2
    start(q, 6, [50, 51, 52, 53])
    assert "not the --disaggregation-decode-tp 2 this prefill server was started with" in failed(q)
    q = queue()
    q.decode_tp = 1
    start(q, 6, [50, 51, 52, 53])
    [(name, *_)] = q.executor.calls
    assert name == "_transfer"
