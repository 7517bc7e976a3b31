"""EAGLE / NEXTN under PD (`disaggregation/draft_state.py`), without servers: the MTP output row the prefill
server sends with the first token arrives in the decode server's stash row bit for bit (bfloat16 too), a
poll's rows in one forward-stream call on each side;
an answer without it, or of another size or dtype, is refused in one sentence (and fails its request
whole, what it held freed); and a pool layout with the MTP
draft layer's KV meets one without it with a refusal naming --speculative-algorithm, before any
transfer (the end-to-end check: test/registered/disaggregation/test_pd_mtp_nightly.py)."""

from __future__ import annotations

from concurrent.futures import Future
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.disaggregation import draft_state
from sglang.srt.disaggregation.destination import malformed_layout
from sglang.srt.disaggregation.draft_state import (
    FIELD,
    answered_stash_row,
    stash_row_messages,
    write_stash_rows,
)
from sglang.srt.disaggregation.prefill import _Room
from sglang.srt.disaggregation.staging import StagedRange, Staging
from sglang.srt.disaggregation.state_packer import StatePacker
from sglang.srt.disaggregation.transfer import PoolLayout
from sglang.srt.managers.io_struct import BootstrapInfo
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.scheduler_io import SchedulerIOMixin
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.mamba_strategy import MambaStrategy
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MHATokenToKVPool
from sglang.test.ci_register import register_cpu_ci
from sglang.test.mem_cache_sim import SYNTHETIC_PARAMS
from sglang.test.pd_fakes import RecordingChannel, decode_queue, prefill_queue

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def _sched(rows: int, hidden: int, dtype: torch.dtype) -> SimpleNamespace:
    stash = SimpleNamespace(hidden=torch.zeros(rows, hidden, dtype=dtype))
    return SimpleNamespace(spec=SimpleNamespace(draft=SimpleNamespace(stash=stash)))


def stash_row_message(sched, req, encode: bool = True) -> dict:
    """One request's "done" field (the prefill side reads a poll's rows together)."""
    [msg] = stash_row_messages(sched, [req], encode)
    return msg


def write_stash_row(sched, req, msg: dict) -> str | None:
    """One answer's row into `req`'s stash row, or why not (the decode side writes a poll's rows together)."""
    row = answered_stash_row(sched, msg)
    if isinstance(row, str):
        return row
    if row is not None:
        write_stash_rows(sched, [(req.req_pool_idx, row)])
    return None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_stash_row_arrives_bit_for_bit(dtype):
    prefill, decode = _sched(4, 24, dtype), _sched(6, 24, dtype)
    g = torch.randn(24, generator=torch.Generator().manual_seed(0)).to(dtype)
    g[3] = float("-inf")  # (raw bytes, not numbers: anything a row holds survives)
    prefill.spec.draft.stash.hidden[2] = g
    msg = stash_row_message(prefill, SimpleNamespace(req_pool_idx=2))
    assert write_stash_row(decode, SimpleNamespace(req_pool_idx=5), msg) is None
    got = decode.spec.draft.stash.hidden
    assert torch.equal(got[5].view(torch.uint8), g.view(torch.uint8))
    assert not got[:5].any()  # (no other row is written)
    # (a TP rank other than the one sending the answer sends nothing)
    assert stash_row_message(prefill, SimpleNamespace(req_pool_idx=2), encode=False) == {}
    # A rank that does not send the answer reads no row (one past the stash would raise if it did).
    assert stash_row_message(prefill, SimpleNamespace(req_pool_idx=10**6), encode=False) == {}


def test_answers_without_a_fitting_row_are_refused():
    decode, req = _sched(2, 8, torch.bfloat16), SimpleNamespace(req_pool_idx=1)
    assert "same --speculative-algorithm" in write_stash_row(decode, req, {})
    assert "not base64" in write_stash_row(decode, req, {FIELD: "@@"})
    other = stash_row_message(_sched(1, 16, torch.bfloat16), SimpleNamespace(req_pool_idx=0))
    assert "32 bytes, 16 expected" in write_stash_row(decode, req, other)
    # The same bytes in another dtype (float16: the same size; float32 of half the hidden size) are
    # another meaning, refused by the dtype the row is sent with.
    for dtype, hidden in ((torch.float16, 8), (torch.float32, 4)):
        other = _sched(1, hidden, dtype)
        other.spec.draft.stash.hidden.fill_(1.0)
        why = write_stash_row(decode, req, stash_row_message(other, SimpleNamespace(req_pool_idx=0)))
        assert why == (f"the MTP draft state is {str(dtype)[6:]}, bfloat16 here (start both servers with the "
                       "same --dtype)"), why  # fmt: skip
    fp16 = stash_row_message(_sched(1, 8, torch.float16), SimpleNamespace(req_pool_idx=0))
    assert "no dtype named" in write_stash_row(decode, req, {FIELD: fp16[FIELD]})
    assert not decode.spec.draft.stash.hidden.any()
    # Neither side runs EAGLE / NEXTN (NGRAM's worker has no MTP stash): nothing sent, nothing read.
    plain = SimpleNamespace(spec=SimpleNamespace())
    assert stash_row_message(plain, req) == {}
    assert write_stash_row(plain, req, {}) is None


def test_layouts_with_and_without_the_draft_layer_are_refused():
    # Two full-attention layers plus the MTP layer's (K and V each) against the same model without it.
    mtp = PoolLayout([1] * 6, [8] * 6, 8, [], [], [], "torch.bfloat16", draft_kv_layers=1)
    plain = PoolLayout([1] * 4, [8] * 4, 8, [], [], [], "torch.bfloat16")
    for a, b in ((mtp, plain), (plain, mtp)):
        why = a.mismatch(PoolLayout.from_dict(b.to_dict()))
        assert "MTP draft layer" in why and "--speculative-algorithm" in why
    assert mtp.mismatch(PoolLayout.from_dict(mtp.to_dict())) is None
    # (a peer's layout that names no count is one without the layer)
    old = {k: v for k, v in plain.to_dict().items() if k != "draft_kv_layers"}
    assert PoolLayout.from_dict(old).draft_kv_layers == 0

    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    assert malformed_layout(mtp.to_dict(), is_int) is None
    assert "draft_kv_layers" in malformed_layout(mtp.to_dict() | {"draft_kv_layers": "1"}, is_int)


def test_a_done_whose_row_does_not_fit_fails_its_request_and_frees_what_it_held():
    """`DecodeTransferQueue._on_done` on a staged "done" whose MTP row is refused (float16 into this
    server's bfloat16 stash): the request is answered 500, no token is committed, and its KV positions,
    request row, mamba slot and staging range are all free again (the scheduler's own abort_with_status;
    the release as the result processor's: `release_kv_cache`, then the PD queue's `on_released`)."""
    req_pool = HybridReqToTokenPool(4, 4, 64, SYNTHETIC_PARAMS, MambaStrategy.resolve(
        "no_buffer", radix_cache=False, overlap=False, cache_chunk_size=4))  # fmt: skip
    kv, tokens = MHATokenToKVPool(32, 1, torch.float32, head_num=1, head_dim=4, layer_ids=[0]), PagedTokenAllocator(32)
    tree = ChunkCache(req_pool, tokens)
    free = (req_pool.available_size(), req_pool.mamba_allocator.available_size(), tokens.available_size())
    sched = _sched(4, 8, torch.bfloat16)
    q = decode_queue(sched)
    q.staging = Staging.create(StatePacker.of(kv, req_pool.mamba_pool, "cpu"), 4096, 4096)
    sent, released = [], []

    def release_finished(r):
        release_kv_cache(r, tree, is_insert=False)
        released.append(r)
        q.on_released(r)

    sched.disagg, sched.counters = q, {"num_generation_tokens_total": 0}
    def commit(r, token, check):  # (the decoding goes on: it would join the running batch)
        if token is not None:
            r.output_ids.append(token)
        return False

    sched.result_processor = SimpleNamespace(release_finished=release_finished, send_finished=sent.extend,
                                             commit=commit)  # fmt: skip
    sched.abort_with_status = partial(SchedulerIOMixin.abort_with_status, sched)
    r = Req("rid-a", [5, 6, 7])
    r.bootstrap = BootstrapInfo("127.0.0.1", 8998, "a")
    req_pool.alloc([r])
    r.kv_indices = tokens.alloc_pages(3)
    start = q.staging.alloc(q.staging.range_bytes(3))
    q.staged["a"] = StagedRange(r, start, q.staging.range_bytes(3), 0)
    q.transfers["a"], q.dst_sent = (r, 0.0), {"a"}
    held = (req_pool.available_size(), req_pool.mamba_allocator.available_size(), tokens.available_size())
    assert q.staging.in_use() == 1 and held == (free[0] - 1, free[1] - 1, free[2] - 3)
    row = stash_row_message(_sched(1, 8, torch.float16), SimpleNamespace(req_pool_idx=0))
    arrived = []
    q._on_done({"type": "done", "room": "a", "ok": True, "output_ids": [9], "chunk": [0, 3, True], **row}, arrived)
    assert arrived == []
    assert r.output_ids == [] and r.finished_reason is not None, (r.output_ids, q.ready)
    assert r.finished_reason["status_code"] == 500 and "--dtype" in r.finished_reason["message"]
    assert sent == [r] and released == [r]  # answered, released once
    assert q.stats["failed_transfers"] == 1 and q.stats["transfers"] == 0
    assert not (q.transfers or q.zombies or q.ready or q.staged) and q.channel.sent == []  # (no cancel)
    assert q.staging.in_use() == 0
    assert (req_pool.available_size(), req_pool.mamba_allocator.available_size(), tokens.available_size()) == free
    assert not sched.spec.draft.stash.hidden.any()


class CountingWorker:
    """The forward worker's `call`, counted (on CUDA each is a blocking round trip through the stream)."""

    def __init__(self):
        self.calls = 0

    def call(self, fn):
        self.calls += 1
        return fn()


def test_one_poll_moves_every_finished_rows_in_one_forward_stream_call_on_each_side(monkeypatch):
    """Issue 56: N transfers that end in one poll cost one forward-stream call on each side, not N (the
    per-request code made N blocking round trips on CUDA), and each row lands in its request's row. Host
    stashes take the forward stream's path here (`_needs_stream`, the device check). A transfer that
    failed reads no row; an answer whose row does not fit fails its request alone."""
    monkeypatch.setattr(draft_state, "_needs_stream", lambda stash: True)
    n, hidden = 5, 16
    prefill = _sched(8, hidden, torch.bfloat16)
    prefill.spec.draft.stash.hidden.copy_(torch.randn(8, hidden, generator=torch.Generator().manual_seed(1)))
    prefill.worker, prefill.abort_with_status = CountingWorker(), lambda *a: None
    prefill.result_processor = SimpleNamespace(release_finished=lambda r: None, send_finished=lambda rs: None)
    p = prefill_queue(prefill)
    p.channel = RecordingChannel()
    p.channel.recv_all = list
    reqs = []
    for i in range(n + 1):  # (the last one's transfer fails)
        r = Req(f"rid-{i}", [5, 6, 7])
        r.req_pool_idx, r.output_ids = (i * 3) % 8, [9]  # (rows 0, 3, 6, 1, 4; 7 for the failed one)
        done = Future()
        if i < n:
            done.set_result((64, 0.001))
        else:
            done.set_exception(RuntimeError("the write failed"))
        p.rooms[str(i)] = _Room(req=r, dst={"notify": "tcp://127.0.0.1:1", "room": str(i)}, future=done)
        reqs.append(r)
    assert p.poll() and prefill.worker.calls == 1
    answers = [m for _, m in p.channel.sent if m["ok"]]
    assert len(answers) == n and len(p.channel.sent) == n + 1

    decode = _sched(12, hidden, torch.bfloat16)
    decode.worker, decode.counters, decode.running = CountingWorker(), {"num_generation_tokens_total": 0}, []
    decode.processed_batch_id, decode.num_batches, decode.max_running_requests = 0, 0, 64
    aborted = []
    decode.abort_with_status = lambda rs, msg, code, *a: aborted.append((rs, code, msg))

    def commit(r, token, check):
        if token is not None:
            r.output_ids.append(token)
        return False

    decode.result_processor = SimpleNamespace(commit=commit, stream_output=lambda rs: None)
    q = decode_queue(decode)
    odd = {FIELD: draft_state.encode_row(torch.ones(hidden, dtype=torch.float16)), draft_state.DTYPE_FIELD: "float16"}
    answers.append({"type": "done", "room": "odd", "ok": True, "output_ids": [9], **odd})  # (refused: float16)
    q.channel.recv_all = lambda: answers
    targets = {}
    for j, msg in enumerate(answers):
        r = Req(f"d-{msg['room']}", [5, 6, 7])
        r.bootstrap, r.req_pool_idx = BootstrapInfo("127.0.0.1", 8998, msg["room"]), 11 - 2 * j
        q.transfers[msg["room"]] = (r, 0.0)
        targets[msg["room"]] = r
    assert q.poll() and decode.worker.calls == 1
    assert [(rs[0].rid, code) for rs, code, _ in aborted] == [("d-odd", 500)] and "--dtype" in aborted[0][2]
    got = decode.spec.draft.stash.hidden
    for i in range(n):
        r = targets[str(i)]
        assert torch.equal(got[r.req_pool_idx], prefill.spec.draft.stash.hidden[reqs[i].req_pool_idx])
        assert r.output_ids == [9] and r in decode.running
    written = {targets[str(i)].req_pool_idx for i in range(n)}
    assert not got[[k for k in range(12) if k not in written]].any()  # (no other row, the refused one's neither)
    assert q.stats["transfers"] == n and q.stats["failed_transfers"] == 1
