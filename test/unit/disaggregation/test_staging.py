"""The staged transfer path's packing (disaggregation/staging.py, state_packer.py) on CPU tensors: the
same code the CUDA path runs (there with a copy stream and pinned buffers). A request's KV rows and state
slot packed from one server's pools and unpacked into another's land in the right rows, bit for bit, and
touch nothing else; the staging buffer's ranges never overlap; the last chunks of the transfers a poll
ends are unpacked together, with one copy-stream wait."""

from __future__ import annotations

import ctypes
import random
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.disaggregation.staged_route import StagedRoute, staged_route
from sglang.srt.disaggregation.staging import (
    ByteRanges,
    ChunkLink,
    StagedRange,
    Staging,
    chunk_plan,
    host_buffer,
    staging_sizes,
)
from sglang.srt.disaggregation.state_packer import StatePacker
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgsError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def pools(seed: int, fill: bool):
    g = torch.Generator().manual_seed(seed)
    kv = [torch.zeros(64, 2, 8, dtype=torch.bfloat16) for _ in range(4)]  # K, V of two layers
    states = [torch.zeros(6, 3, 5, dtype=torch.float32), torch.zeros(6, 2, 4, 4, dtype=torch.float16)]
    if fill:
        for b in kv + states:
            b.copy_(torch.randn(b.shape, generator=g).to(b.dtype))
    return kv, states


def test_pack_then_unpack_moves_exactly_the_requests_rows():
    src_kv, src_states = pools(0, fill=True)
    dst_kv, dst_states = pools(1, fill=False)
    src_tokens = [5, 6, 7, 30, 2, 63]  # runs and jumps, out of order
    dst_tokens = [40, 41, 10, 11, 12, 0]
    packer = StatePacker(src_kv, src_states, "cpu")
    buf = host_buffer(packer.packed_bytes(len(src_tokens)) + 100, pin=False)
    n = packer.pack(src_tokens, 4, buf)
    assert n == len(src_tokens) * sum(b[0].nbytes for b in src_kv) + sum(b[0].nbytes for b in src_states)
    StatePacker(dst_kv, dst_states, "cpu").unpack(buf, dst_tokens, 1)
    for s, d in zip(src_kv, dst_kv, strict=True):
        assert torch.equal(d[dst_tokens], s[src_tokens])
        untouched = [t for t in range(64) if t not in dst_tokens]
        assert not d[untouched].any()
    for s, d in zip(src_states, dst_states, strict=True):
        assert torch.equal(d[1], s[4])
        assert not d[[0, 2, 3, 4, 5]].any()


def test_a_blocks_kv_is_head_major():
    """The layout both servers of a pair assume (`StatePacker`, `staged_route.packed`): each KV buffer's
    part holds head 0 of every token in the slot list's order, then head 1; the state's rows follow."""
    kv, states = pools(0, fill=True)
    tokens = [9, 2, 40]
    packer = StatePacker(kv, states, "cpu")
    buf = host_buffer(packer.packed_bytes(len(tokens)), pin=False)
    packer.pack(tokens, 5, buf)
    at = 0
    for b in kv:  # [rows, 2 heads, 8]
        want = torch.cat([b[tokens, h] for h in range(b.shape[1])]).view(torch.uint8).flatten()
        assert torch.equal(buf[at : at + want.numel()], want)
        at += want.numel()
    for b in states:
        want = b[5].contiguous().view(torch.uint8).flatten()
        assert torch.equal(buf[at : at + want.numel()], want)
        at += want.numel()
    assert at == buf.numel()


def test_byte_ranges_never_overlap_and_reuse_freed_room():
    rng = random.Random(0)
    ranges = ByteRanges(1000)
    held: dict[int, int] = {}
    for _ in range(500):
        if held and rng.random() < 0.45:
            start = rng.choice(list(held))
            ranges.free(start)
            del held[start]
            continue
        n = rng.randint(1, 300)
        start = ranges.alloc(n)
        if start is None:
            # Refused only when no gap of n bytes exists.
            spans = sorted(held.items())
            gaps = [b - (a + m) for (a, m), (b, _) in zip(spans, spans[1:], strict=False)]
            gaps += [spans[0][0] if spans else 1000, 1000 - (spans[-1][0] + spans[-1][1]) if spans else 1000]
            assert max(gaps) < n
            continue
        assert 0 <= start and start + n <= 1000
        assert all(start + n <= a or a + m <= start for a, m in held.items())
        held[start] = n


def test_chunk_plans_cover_the_positions_in_order_within_the_range_and_the_state_once_last():
    for n in (1, 2, 7, 50):
        for token_bytes, state_bytes in ((8, 0), (8, 20), (8, 64), (0, 16)):
            for cap in range(max(token_bytes, state_bytes, 1), 120, 7):
                plan = chunk_plan(n, token_bytes, state_bytes, cap)
                assert [a for a, _, _ in plan] == [0] + [b for _, b, _ in plan[:-1]]
                assert plan[-1][1] == n and [s for _, _, s in plan] == [False] * (len(plan) - 1) + [True]
                assert all((b - a) * token_bytes + (state_bytes if s else 0) <= cap for a, b, s in plan)
                assert all(a < b for a, b, s in plan if not s)
                # As few chunks as whole positions allow: each full one but the last holds cap // token_bytes.
                if token_bytes:
                    assert all(b - a == cap // token_bytes for a, b, _ in plan[:-2])
    with pytest.raises(ValueError, match="holds neither a position"):
        chunk_plan(4, 8, 20, 19)


def staged_pair(chunk_bytes: int):
    """A prefill side's staging (its buffer one chunk) and a decode side's (a pool of two chunks), over
    the pools of `pools`; a request of 13 positions whose KV and state are far larger than a chunk."""
    src_kv, src_states = pools(0, fill=True)
    dst_kv, dst_states = pools(1, fill=False)
    prefill = Staging.create(StatePacker(src_kv, src_states, "cpu"), chunk_bytes, chunk_bytes)
    decode = Staging.create(StatePacker(dst_kv, dst_states, "cpu"), 2 * chunk_bytes, chunk_bytes)
    src_tokens = [9, 10, 11, 12, 40, 41, 3, 60, 61, 62, 63, 20, 21]
    req = SimpleNamespace(rid="r", origin_input_ids=list(range(15)), mamba_pool_idx=5,
                          kv_indices=[0, 1] + [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 50, 51, 52])  # fmt: skip
    length = decode.range_bytes(len(src_tokens))
    entry = StagedRange(req, decode.ranges.alloc(length), length, prefix=2)
    return prefill, decode, src_tokens, entry, (src_kv, src_states, dst_kv, dst_states)


def route(session: str, dst: tuple[int, int], staging: Staging) -> StagedRoute:
    """The route of a destination at the same --tp-size (one decode rank): its range `dst` (address,
    bytes) of its session."""
    target = {"session": session, "layout": {}, "staging": dst[0], "staging_bytes": dst[1]}
    return staged_route([None], {"ranks": [target]}, 0, staging)


def memmove(session: str, descriptors: list[tuple[int, int, int]]) -> None:
    """A transfer engine within one process: each descriptor one copy."""
    for src, dst, n in descriptors:
        ctypes.memmove(dst, src, n)


def test_a_request_larger_than_the_staging_range_moves_in_chunks_through_fixed_buffers():
    # pools(): 128 bytes of KV a position (two layers' K and V, 32 bytes each) and a 124-byte state. A
    # 300-byte chunk holds 2 positions: 13 positions move in 7 chunks, the state with the last.
    chunk = 300
    prefill, decode, src_tokens, entry, (src_kv, src_states, dst_kv, dst_states) = staged_pair(chunk)
    sizes = (prefill.buffer.nbytes, decode.buffer.nbytes)
    assert entry.length == chunk and decode.packer.packed_bytes(13) > 4 * chunk
    link = ChunkLink()
    dst = (decode.address(entry.start), entry.length)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(prefill.send, memmove, route("s", dst, prefill), src_tokens, 4, link, 10.0)
        chunks = 0
        while not future.done():  # the scheduler threads of both servers: announce, unpack, acknowledge
            for c in link.drain():
                assert decode.receive(entry, c) is None
                chunks += 1
                link.ack(c)
            time.sleep(0.001)
        nbytes, last = future.result()
    assert decode.receive(entry, last) is None and entry.complete()
    assert chunks + 1 == 7 and last == [12, 13, True]
    assert nbytes == decode.packer.packed_bytes(13)
    assert (prefill.buffer.nbytes, decode.buffer.nbytes) == sizes  # never grown
    for s, d in zip(src_kv, dst_kv, strict=True):
        assert torch.equal(d[entry.tokens()], s[src_tokens])
        assert not d[[t for t in range(64) if t not in entry.tokens()]].any()
    for s, d in zip(src_states, dst_states, strict=True):
        assert torch.equal(d[5], s[4]) and not d[[0, 1, 2, 3, 4]].any()


def test_chunks_out_of_order_or_past_the_range_are_refused_and_a_cancel_stops_the_sender():
    prefill, decode, src_tokens, entry, _ = staged_pair(300)
    for bad in ([1, 3, False], [0, 5, False], [0, 13, True], [0, 2], "x", [0, 0, False], [0, True, False]):
        assert "not the next part of the prompt's 13 positions" in decode.receive(entry, bad)
    assert decode.receive(entry, [0, 2, False]) is None
    assert "(2 received)" in decode.receive(entry, [0, 2, False])  # a repeat
    link = ChunkLink()
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(
            prefill.send, memmove, route("s", (decode.address(0), 300), prefill), src_tokens, 4, link, 10.0
        )
        while not link.drain():
            time.sleep(0.001)
        link.cancel()  # the decode server gave the request up while the first chunk waited for its ack
        with pytest.raises(RuntimeError, match="cancelled by the decode server"):
            future.result(timeout=5)
    writes = []
    link = ChunkLink()
    link.cancel()  # cancelled while it waited behind another transfer: nothing is written (review (a))
    with pytest.raises(RuntimeError, match="cancelled by the decode server"):
        prefill.send(lambda *a: writes.append(a), route("s", (decode.address(0), 300), prefill), src_tokens, 4, link,
                     10.0)  # fmt: skip
    assert writes == []


def test_a_chunk_that_cannot_be_unpacked_fails_its_request_not_the_decode_loop(monkeypatch):
    """An error while writing a chunk into the pools (a float8 KV buffer took `index_copy_` before 9927c6d)
    comes back as the request's refusal, which `_on_chunk` / `_on_done` answer with a 500; it used to
    propagate out of the decode server's scheduler loop, ending the server for every client."""
    _, decode, _, entry, _ = staged_pair(300)

    def broken(*args):
        raise NotImplementedError('"index_copy_cpu" not implemented for \'Float8_e4m3fn\'')

    monkeypatch.setattr(decode.packer, "unpack_many", broken)
    error = decode.receive(entry, [0, 2, False])
    assert error.startswith("its staged chunk [0, 2, False] could not be written here (NotImplementedError")
    assert entry.received == 0 and not entry.state  # nothing counted as arrived
    # Under TP the error is raised (review R2 finding 2): it may be this rank's alone (a CUDA out of
    # memory), and a refusal here while the other ranks admit the request would leave their schedulers
    # running different batches. The rank's loop ends instead, as before the refusal was added.
    tp = Staging.create(decode.packer, decode.buffer.nbytes, decode.chunk_bytes, tp_size=2)
    assert decode.fail_alone and not tp.fail_alone
    with pytest.raises(NotImplementedError, match="index_copy_cpu"):
        tp.receive(entry, [0, 2, False])
    assert entry.received == 0 and not entry.state


def test_the_wait_for_an_acknowledgement_counts_only_while_the_scheduler_polls():
    """Review finding 4: a pause of the prefill server (its scheduler does not poll) made every staged
    transfer in flight fail once the wall clock passed the acknowledgement's deadline."""
    prefill, decode, src_tokens, _, _ = staged_pair(300)
    link = ChunkLink()
    with ThreadPoolExecutor(1) as pool:
        dst = route("s", (decode.address(0), 300), prefill)
        future = pool.submit(prefill.send, memmove, dst, src_tokens, 4, link, 0.05)
        time.sleep(0.3)  # paused: no polls, six times the limit passes
        assert not future.done()
        while not future.done():  # polling again: the limit runs out
            link.heartbeat()
            time.sleep(0.01)
        with pytest.raises(RuntimeError, match="did not acknowledge a staged chunk within 0.05 s"):
            future.result()


def test_the_wait_for_an_acknowledgement_counts_all_the_time_the_scheduler_polls_at_its_own_pace():
    """The wait counted only its 50 ms looks in which a poll fell: with polls every 150 ms (an idle TP
    loop's pace is that of its exchange), a third of the time, so a 60 s limit took ~180 s."""
    link = ChunkLink()
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        future = pool.submit(link.wait_ack, [0, 10, False], 0.5)
        while not future.done():
            link.heartbeat()
            time.sleep(0.15)
        seconds = time.monotonic() - start
    with pytest.raises(RuntimeError, match="did not acknowledge a staged chunk within 0.5 s"):
        future.result()
    assert seconds < 1.0, seconds  # (0.5 s and a poll's 0.15 here; ~1.5 s when a third counted)


def test_staging_sizes_are_bounded_and_a_chunk_below_one_position_and_the_state_is_refused():
    packer = StatePacker(*pools(0, fill=False), "cpu")
    least = packer.packed_bytes(1)
    mib = 1 << 20
    with envs.SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB.override(0.25), envs.SGLANG_DISAGG_STAGING_POOL_SIZE_MB.override(1):
        # A chunk is never larger than a whole prompt; the decode pool never larger than a chunk per row.
        assert staging_sizes("prefill", packer, 4096, 8) == (mib // 4, mib // 4)
        assert staging_sizes("decode", packer, 4096, 8) == (mib, mib // 4)
        assert staging_sizes("decode", packer, 4096, 2) == (mib // 2, mib // 4)
        assert staging_sizes("prefill", packer, 10, 8) == (-(-packer.packed_bytes(10) // 256) * 256,) * 2
    with envs.SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB.override((least - 1) / mib):
        with pytest.raises(ServerArgsError, match="SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB=.* is below one prompt"):
            staging_sizes("prefill", packer, 4096, 8)
    with envs.SGLANG_DISAGG_STAGING_POOL_SIZE_MB.override(0.125):
        with pytest.raises(ServerArgsError, match="SGLANG_DISAGG_STAGING_POOL_SIZE_MB=0.125 is below one"):
            staging_sizes("decode", packer, 4096, 8)


def test_aligned_byte_ranges_start_on_the_alignment():
    ranges = ByteRanges(1024, align=256)
    assert [ranges.alloc(n) for n in (1, 300, 200, 10)] == [0, 256, 768, None]
    ranges.free(256)
    assert ranges.alloc(512) == 256


@pytest.mark.parametrize("chunk_mb, pool_mb, context_len, rows", [(0.02, 0.02, 4096, 8), (256, 1024, 4095, 3)])
def test_every_request_row_gets_a_range_of_a_decode_buffer_sized_by_staging_sizes(
    chunk_mb, pool_mb, context_len, rows
):
    """Review finding 2: ranges start on 256 bytes, but the chunk was not a multiple of 256: with a
    fractional MiB (0.02: 20971 bytes) no range of a whole chunk ever fitted the buffer, and with a chunk
    capped at a whole prompt (524284 bytes) only 2 of 3 rows' ranges fitted; the request waited forever
    and every later one behind it. Chunks and buffers now come in whole 256-byte units and whole chunks."""
    packer = StatePacker(*pools(0, fill=False), "cpu")
    chunk_env, pool_env = envs.SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB, envs.SGLANG_DISAGG_STAGING_POOL_SIZE_MB
    with chunk_env.override(chunk_mb), pool_env.override(pool_mb):
        nbytes, chunk = staging_sizes("decode", packer, context_len, rows)
    assert chunk % 256 == 0 and nbytes % chunk == 0
    st = Staging.create(packer, nbytes, chunk)
    starts = [st.ranges.alloc(st.range_bytes(context_len)) for _ in range(nbytes // chunk)]
    assert None not in starts and len(starts) == min(rows, int(pool_mb * (1 << 20)) // chunk)


def test_unpack_views_parts_of_mixed_dtypes_whatever_their_offsets():
    """Review finding 7: parts follow each other unpadded, so a float32 SSM state after a bf16 conv state
    of odd size started at an offset that is not a multiple of 4, and the view of its bytes raised (a
    RuntimeError the scheduler did not catch)."""
    kv = [torch.arange(32, dtype=torch.bfloat16).view(16, 2) for _ in range(2)]
    states = [torch.randn(4, 3, 5).to(torch.bfloat16), torch.randn(4, 2, 4)]
    src = StatePacker(kv, states, "cpu")
    buf = host_buffer(4096, pin=False)
    src.pack([1, 2], 1, buf)
    dst_kv, dst_states = [torch.zeros_like(b) for b in kv], [torch.zeros_like(b) for b in states]
    StatePacker(dst_kv, dst_states, "cpu").unpack(buf, [3, 4], 2)
    for s, d in zip(kv, dst_kv, strict=True):
        assert torch.equal(d[[3, 4]], s[[1, 2]])
    for s, d in zip(states, dst_states, strict=True):
        assert torch.equal(d[2], s[1])


def test_a_freed_range_is_zeroed_off_the_loop_and_taken_back_only_zeroed():
    """Review finding 5: the decode server zeroed each whole range (up to 256 MiB, ~9 ms) on its scheduler
    loop as the destination went out. Now `free` hands the zeroing to a thread; the range is taken back
    only when nothing else fits, after its zeroing, so every TP rank picks the same starts."""
    packer = StatePacker(*pools(0, fill=False), "cpu")
    st = Staging.create(packer, 3 * 512, 512)
    a, b = st.alloc(512), st.alloc(512)
    st.buffer[a : a + 512] = 7  # what a request's chunks left in its range
    st.free(a)
    assert st.in_use() == 1 and st.alloc(512) == 1024  # the free room first, whatever the zeroing's pace
    assert st.alloc(512) == a and not st.buffer[a : a + 512].any()  # then the zeroed range
    assert st.alloc(1) is None and b == 512


_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _cuda])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_kv_packs_unpacks_and_clears_bit_for_bit(kv_dtype, device):
    """Review finding 3: with `--kv-cache-dtype fp8_e4m3 / fp8_e5m2` the unpack (`index_copy_`) and the
    direct path's clear (`index_fill_`) raised NotImplementedError: torch has neither for float8. Rows
    move as bytes now; compared as bytes (torch.equal has no float8 form). On CUDA: the copy stream and
    pinned buffers of the staged path, and several blocks unpacked together (`unpack_many`)."""
    g = torch.Generator().manual_seed(3)
    kv = [torch.randn(32, 2, 8, generator=g).to(device, kv_dtype) for _ in range(4)]
    states = [torch.randn(4, 3, 5, generator=g).to(device),
              torch.randn(4, 2, 4, generator=g).to(device, torch.bfloat16)]  # fmt: skip
    src = StatePacker(kv, states, device)
    buf = host_buffer(src.packed_bytes(3), pin=device == "cuda")
    src.pack([7, 1, 30], 2, buf)
    dst_kv = [torch.full_like(b, 1.0) for b in kv]  # (non-zero, so the clear has something to do)
    dst_states = [torch.full_like(b, 1.0) for b in states]
    dst = StatePacker(dst_kv, dst_states, device)
    dst.clear([4, 5, 6], 1)
    untouched = [t for t in range(32) if t not in (4, 5, 6)]
    for d in dst_kv:
        d = d.cpu().view(torch.uint8)
        assert not d[[4, 5, 6]].any() and d[untouched].all()
    assert all(not d[1].any() and d[[0, 2, 3]].all() for d in (t.cpu() for t in dst_states))
    dst.unpack(buf, [4, 5, 6], 1)
    for s, d in zip(kv, dst_kv, strict=True):
        assert torch.equal(d.cpu().view(torch.uint8)[[4, 5, 6]], s.cpu().view(torch.uint8)[[7, 1, 30]])
    for s, d in zip(states, dst_states, strict=True):
        assert torch.equal(d[1].cpu(), s[2].cpu())
    # Blocks unpacked together (a poll's last chunks): one without its state (a request's positions
    # only), one with it; the rows of each, the states of the second, the first's untouched.
    blocks = [([3, 8], None, [10, 11]), ([20], 0, [12])]
    pin = device == "cuda"
    bufs = [host_buffer(src.packed_bytes(len(t), slot is not None), pin=pin) for t, slot, _ in blocks]
    for buf, (tokens, slot, _) in zip(bufs, blocks, strict=True):
        src.pack(tokens, slot, buf)
    dst.unpack_many([(bufs[0], [10, 11], None), (bufs[1], [12], 3)])
    for s, d in zip(kv, dst_kv, strict=True):
        assert torch.equal(d.cpu().view(torch.uint8)[[10, 11, 12]], s.cpu().view(torch.uint8)[[3, 8, 20]])
    for s, d in zip(states, dst_states, strict=True):
        assert torch.equal(d[3].cpu(), s[0].cpu()) and torch.equal(d[1].cpu(), s[2].cpu())
        assert d[[0, 2]].all()  # (still the 1.0 fill: no state written there)


class _StandInStream:
    """A CUDA copy stream's stand-in for `StatePacker` on CPU: records entering it (`_on`), leaving it,
    its synchronize, and each zeroing op (`index_fill_`, `zero_`) with whether it ran inside the stream
    block."""

    def __init__(self, monkeypatch):
        import sglang.srt.disaggregation.state_packer as packing

        self.log: list = []
        self.inside = False
        self.zeroed: list[bool] = []
        stand_in = self

        class On:
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                stand_in.inside = True
                stand_in.log.append(("enter", self.stream))

            def __exit__(self, *exc):
                stand_in.inside = False
                stand_in.log.append("exit")

        monkeypatch.setattr(packing, "_on", On)

    def synchronize(self):
        self.log.append("synchronize")

    def ops(self):
        from torch.overrides import TorchFunctionMode

        stand_in = self

        class Ops(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in ("index_fill_", "zero_"):
                    stand_in.zeroed.append(stand_in.inside)
                return func(*args, **(kwargs or {}))

        return Ops()


def test_clear_runs_on_the_copy_stream_and_is_done_when_it_returns(monkeypatch):
    """Review finding 4: on the direct GPU path the decode server clears a destination's rows, then asks
    the prefill server to write into them. The clear ran on the caller's stream without a wait, so the
    zeroing could run after the transfer and wipe it. It now runs on the packer's stream, synchronized
    before it returns. (CPU: a stand-in stream records what `clear` does with it, and that every zeroing
    ran inside its block: review R2 finding 6, a zeroing moved out of it would run on the caller's
    stream.)"""
    kv, states = pools(0, fill=True)
    packer = StatePacker(kv, states, "cpu")
    packer.stream = stream = _StandInStream(monkeypatch)
    with stream.ops():
        packer.clear([3, 9], 2)
    assert stream.log == [("enter", stream), "exit", "synchronize"]
    assert stream.zeroed == [True] * (len(kv) + len(states))  # an index_fill_ per KV buffer, a zero_ per state
    assert not any(b[[3, 9]].any() for b in kv) and not any(b[2].any() for b in states)


def test_a_poll_clears_all_its_destinations_then_waits_once_before_sending_any(monkeypatch):
    """Review R2 finding 5: the decode side cleared each released destination with its own blocking
    wait for the copy stream (one sync per request on the scheduler thread). A poll now clears all of
    its destinations' rows inside one stream block, waits once, and only then sends (the transfer
    writes straight into those rows: a send before the wait could land under the zeros)."""
    from sglang.srt.managers.io_struct import BootstrapInfo
    from sglang.srt.managers.schedule_batch import Req
    from sglang.test.pd_fakes import decode_queue

    kv, states = pools(0, fill=True)
    q = decode_queue(SimpleNamespace(processed_batch_id=5, num_batches=5))
    q.device_packer = StatePacker(kv, states, "cpu")
    q.device_packer.stream = stream = _StandInStream(monkeypatch)
    rows = {"a": ([3, 9], 1), "b": ([20, 21, 22], 4), "c": ([40], 5)}
    for room, (tokens, slot) in rows.items():
        r = Req(f"rid-{room}", [5] * len(tokens))
        r.bootstrap = BootstrapInfo("127.0.0.1", 8998, room)
        r.kv_indices, r.mamba_pool_idx = tokens, slot
        q.reserved.append((r, 5, 0))
    send = q.channel.send

    def logged_send(url, msg):
        stream.log.append(("send", msg["room"]))
        return send(url, msg)

    q.channel.send = logged_send
    with stream.ops():
        assert q._send_destinations()
    assert stream.log == [("enter", stream), "exit", "synchronize", ("send", "a"), ("send", "b"), ("send", "c")]
    assert stream.zeroed == [True] * (len(kv) + len(states))  # one op per buffer for the three together
    for tokens, slot in rows.values():
        assert not any(b[tokens].any() for b in kv) and not any(b[slot].any() for b in states)
    untouched = [t for t in range(64) if t not in (3, 9, 20, 21, 22, 40)]
    assert all(b[untouched].all() for b in kv) and all(b[[0, 2, 3]].all() for b in states)


@pytest.mark.parametrize("op", ["pack", "unpack", "clear"])
def test_the_copy_stream_is_waited_for_also_when_the_packer_raises(monkeypatch, op):
    """Review R2 finding 3: the copy stream's synchronize came after the stream block, so an error inside
    it (a size mismatch in the state part, say, after the block's host-to-device copy and some KV copies
    were queued) skipped it, and since 5d5a78d the request is failed and its rows and range freed with
    those copies possibly still queued. `pack`, `unpack` and `clear` now wait in a `finally`."""
    import sglang.srt.disaggregation.state_packer as packing

    kv, states = pools(0, fill=True)
    packer = StatePacker(kv, states, "cpu")
    buf = host_buffer(packer.packed_bytes(2), pin=False)
    packer.pack([1, 2], 1, buf)
    packer.stream = stream = _StandInStream(monkeypatch)

    def broken(t):
        raise RuntimeError("the rows cannot be written")

    monkeypatch.setattr(packing, "byte_rows", broken)  # (called inside the stream block by all three)
    call = {"pack": lambda: packer.pack([1, 2], 1, buf), "unpack": lambda: packer.unpack(buf, [5, 6], 3),
            "clear": lambda: packer.clear([5, 6], 3)}[op]  # fmt: skip
    with pytest.raises(RuntimeError, match="cannot be written"):
        call()
    assert stream.log == [("enter", stream), "exit", "synchronize"]


def _staged_poll(monkeypatch, tp_size: int = 1, slot_c: int = 3):
    """A decode queue on the staged path over `pools` (decode side empty, a stand-in copy stream), four
    requests of 3 or 4 positions whose transfers end in one poll: each "done" carries its last chunk,
    which a prefill server packed from its own pools (`pools(0)`) into the request's range. One request
    (room "c") already received its first 2 positions in an earlier chunk. Returns the queue, the
    answers, what each request's rows must hold, the stand-in stream and the list of `unpack_many` calls.
    `slot_c`: room "c"'s destination state slot."""
    from sglang.srt.managers.io_struct import BootstrapInfo
    from sglang.srt.managers.schedule_batch import Req
    from sglang.test.pd_fakes import decode_queue

    src_kv, src_states = pools(0, fill=True)
    src = StatePacker(src_kv, src_states, "cpu")
    dst_kv, dst_states = pools(1, fill=False)
    q = decode_queue(SimpleNamespace(processed_batch_id=0, num_batches=0, running=[], max_running_requests=8,
                                     counters={"num_generation_tokens_total": 0}))  # fmt: skip
    q.staging = Staging.create(StatePacker(dst_kv, dst_states, "cpu"), 4096, 1024, tp_size=tp_size)
    aborted = []

    def abort_with_status(reqs, message, code, *a):
        aborted.append((reqs[0].rid, code, message))
        q.on_released(reqs[0])  # (the scheduler's release: the range is freed with the request)

    def commit(r, token, check):
        if token is not None:
            r.output_ids.append(token)
        return False

    q.sched.abort_with_status = abort_with_status
    q.sched.result_processor = SimpleNamespace(commit=commit, stream_output=lambda rs: None)
    plan = {  # room: source rows, destination rows, source slot, destination slot
        "a": ([5, 6, 7], [10, 11, 12], 0, 1),
        "b": ([8, 9, 40], [20, 21, 22], 4, 2),
        "c": ([30, 31, 32, 33], [40, 41, 42, 43], 2, slot_c),
        "d": ([50, 51, 52], [44, 45, 46], 5, 4),
    }
    answers, expected = [], {}
    for room, (src_tokens, dst_tokens, src_slot, dst_slot) in plan.items():
        r = Req(f"rid-{room}", [1] * len(dst_tokens))
        r.bootstrap = BootstrapInfo("127.0.0.1", 8998, room)
        r.kv_indices, r.mamba_pool_idx, r.sampling_params.max_new_tokens = dst_tokens, dst_slot, 8
        length = q.staging.range_bytes(len(dst_tokens))
        entry = q.staged[room] = StagedRange(r, q.staging.alloc(length), length, prefix=0)
        q.transfers[room], q.dst_sent = (r, 0.0), q.dst_sent | {room}
        first = 2 if room == "c" else 0
        if first:  # an earlier chunk (its own poll)
            src.pack(src_tokens[:first], None, q.staging.buffer[entry.start :])
            assert q.staging.receive(entry, [0, first, False]) is None
        src.pack(src_tokens[first:], src_slot, q.staging.buffer[entry.start :])
        answers.append({"type": "done", "room": room, "ok": True, "output_ids": [9],
                        "chunk": [first, len(dst_tokens), True]})  # fmt: skip
        expected[room] = (r, [b[src_tokens] for b in src_kv], [b[src_slot] for b in src_states])
    q.channel.recv_all = lambda: answers
    stream = q.staging.packer.stream = _StandInStream(monkeypatch)
    calls, unpack_many = [], q.staging.packer.unpack_many

    def counted(blocks):
        calls.append([slot for _, _, slot in blocks])
        return unpack_many(blocks)

    monkeypatch.setattr(q.staging.packer, "unpack_many", counted)
    return q, expected, (dst_kv, dst_states), stream, calls, aborted


def test_the_last_chunks_of_a_polls_transfers_are_unpacked_together_with_one_wait(monkeypatch):
    """The last chunk of a staged transfer came with its "done" and was unpacked on its own (on CUDA one
    blocking copy-stream wait per transfer on the scheduler thread). The last chunks of every transfer
    a poll ends are now unpacked in one `unpack_many` (one stream block, one wait), before any of those
    requests is admitted; each request's rows land bit for bit and its range is freed."""
    q, expected, (dst_kv, dst_states), stream, calls, aborted = _staged_poll(monkeypatch)
    assert q.poll()
    assert calls == [[1, 2, 3, 4]] and stream.log == [("enter", stream), "exit", "synchronize"]
    assert aborted == [] and q.stats["staged_chunks"] == 4 and q.stats["transfers"] == 4
    written = set()
    for r, kv_rows, state_rows in expected.values():
        assert r in q.sched.running and r.output_ids == [9]
        assert all(torch.equal(d[r.kv_indices], s) for d, s in zip(dst_kv, kv_rows, strict=True))
        assert all(torch.equal(d[r.mamba_pool_idx], s) for d, s in zip(dst_states, state_rows, strict=True))
        written |= set(r.kv_indices)
    assert all(not b[[t for t in range(64) if t not in written]].any() for b in dst_kv)
    assert all(not b[[0, 5]].any() for b in dst_states)  # (the slots no request holds)
    assert not q.staged and q.staging.in_use() == 0


def test_a_last_chunk_that_cannot_be_written_fails_its_request_alone(monkeypatch):
    """A poll's last chunks unpacked together must not fail together: where the batch raises, each is
    unpacked again alone, and only the request whose chunk raises then gets its 500 (at one TP rank);
    the others are admitted with their rows bit for bit. Under TP the error is raised (fbbeca6)."""
    unpack_many = StatePacker.unpack_many

    def failing(self, blocks):  # (a write error of room "c"'s chunk alone: its state slot is 3)
        if any(slot == 3 for _, _, slot in blocks):
            raise RuntimeError("CUDA error: an illegal memory access")
        return unpack_many(self, blocks)

    monkeypatch.setattr(StatePacker, "unpack_many", failing)
    q, expected, (dst_kv, dst_states), _, calls, aborted = _staged_poll(monkeypatch)
    assert q.poll()
    assert [(rid, code) for rid, code, _ in aborted] == [("rid-c", 500)]
    assert "staged chunk [2, 4, True] could not be written here (RuntimeError: CUDA error" in aborted[0][2]
    assert calls == [[1, 2, 3, 4], [1], [2], [3], [4]]  # the batch, then each alone
    assert q.stats["failed_transfers"] == 1 and q.stats["transfers"] == 3 and q.stats["staged_chunks"] == 3
    for room, (r, kv_rows, state_rows) in expected.items():
        if room == "c":
            assert r not in q.sched.running and r.output_ids == []
            continue
        assert r in q.sched.running and r.output_ids == [9]
        assert all(torch.equal(d[r.kv_indices], s) for d, s in zip(dst_kv, kv_rows, strict=True))
        assert all(torch.equal(d[r.mamba_pool_idx], s) for d, s in zip(dst_states, state_rows, strict=True))
    assert not q.staged and q.staging.in_use() == 0  # (the failed request's range freed with it)
    q, *_, aborted = _staged_poll(monkeypatch, tp_size=2)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        q.poll()
    assert aborted == []


def _admitted_bit_for_bit(q, expected, dst, rooms) -> bool:
    dst_kv, dst_states = dst
    for room in rooms:
        r, kv_rows, state_rows = expected[room]
        assert r in q.sched.running and r.output_ids == [9]
        assert all(torch.equal(d[r.kv_indices], s) for d, s in zip(dst_kv, kv_rows, strict=True))
        assert all(torch.equal(d[r.mamba_pool_idx], s) for d, s in zip(dst_states, state_rows, strict=True))
    return True


def _device_copies(monkeypatch, calls: list) -> list:
    """Records a weak reference to each block's device copy (`Tensor.to` of host bytes) with the number of
    `unpack_many` calls made when it was taken and how many earlier copies were alive then (asserted by
    the caller: an assertion here would be caught as the unpack's error)."""
    import weakref

    copies, to = [], torch.Tensor.to

    def recorded(self, *args, **kwargs):
        out = to(self, *args, **kwargs)
        if out.dtype == torch.uint8:  # (a block's bytes, not an index tensor)
            alive = sum(1 for _, ref, _ in copies if ref() is not None)
            copies.append((len(calls), weakref.ref(out), alive))
        return out

    monkeypatch.setattr(torch.Tensor, "to", recorded)
    return copies


def test_a_polls_unpack_holds_one_blocks_device_copy_at_a_time(monkeypatch):
    """Review of 1f885c6, finding 1: `unpack_many` kept every block's device copy until it returned (and
    a `cat` of them per KV buffer), so a poll's unpack held up to the whole staging pool on the device
    (1 GiB by default) where the per-request unpack held one chunk; an out-of-memory under TP ends the
    server. Each block is now scattered before the next block's copy (one stream block, one wait still):
    at most one block's device copy is alive at any time (1f885c6: all four)."""
    q, expected, dst, stream, calls, aborted = _staged_poll(monkeypatch)
    copies = _device_copies(monkeypatch, calls)
    assert q.poll()
    assert [alive for _, _, alive in copies] == [0, 0, 0, 0]  # (1f885c6: [0, 1, 2, 3])
    assert calls == [[1, 2, 3, 4]] and stream.log == [("enter", stream), "exit", "synchronize"]
    assert aborted == [] and _admitted_bit_for_bit(q, expected, dst, "abcd")


def test_a_batch_that_raised_is_retried_without_its_device_copy_and_logged_once(monkeypatch, caplog):
    """Review of 1f885c6, findings 2 and 3: the block-by-block retry ran inside the `except` block of the
    batch's error, whose traceback kept the batch's frames and their device copy alive through the
    retries (an out-of-memory retried with the memory that ran out still taken); and a batch that raised
    while every chunk then went in alone was logged nowhere. The retries now run after the except block
    (no copy of the batch alive in any of them), and the batch's failure is a warning, at most once per
    `BATCH_WARN_EVERY_S` (with the count since)."""
    import logging

    import sglang.srt.disaggregation.staging as staging

    scatter = StatePacker._scatter

    def out_of_memory_in_the_batch(self, block, idx, slot):  # (its second block, after its copy)
        if len(calls) == 1 and slot == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")
        return scatter(self, block, idx, slot)

    q, expected, dst, _, calls, aborted = _staged_poll(monkeypatch)
    monkeypatch.setattr(StatePacker, "_scatter", out_of_memory_in_the_batch)
    copies = _device_copies(monkeypatch, calls)
    retried, unpack_many = [], q.staging.packer.unpack_many

    def seen(blocks):
        if len(calls) >= 1:  # a retry: which of the batch's device copies are still referenced
            retried.append(sum(1 for n, ref, _ in copies if n == 1 and ref() is not None))
        return unpack_many(blocks)

    monkeypatch.setattr(q.staging.packer, "unpack_many", seen)
    with caplog.at_level(logging.WARNING, logger=staging.__name__):
        assert q.poll()
    assert calls == [[1, 2, 3, 4], [1], [2], [3], [4]] and retried == [0, 0, 0, 0]
    assert [alive for _, _, alive in copies] == [0] * 6  # (the batch's two copies, then one per retry)
    assert aborted == [] and _admitted_bit_for_bit(q, expected, dst, "abcd")
    assert not q.staged and q.staging.in_use() == 0
    [warning] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert warning.levelno == logging.WARNING
    assert "Unpacking 4 staged chunks together failed" in warning.message
    assert "OutOfMemoryError: CUDA out of memory" in warning.message and "0 of them failed" in warning.message
    caplog.clear()
    q.staging._warn_batch(4, 0, "the next")  # (within the interval: counted, not logged)
    assert caplog.records == []
    q.staging.batch_warned -= staging.BATCH_WARN_EVERY_S
    q.staging._warn_batch(3, 1, "a later one")
    [warning] = caplog.records
    assert "(a later one)" in warning.message and "1 of them failed (2 such batch failures" in warning.message


def test_a_batch_that_wrote_some_rows_then_raised_fails_only_its_bad_chunk(monkeypatch):
    """Review of 1f885c6: room "c"'s state slot is out of the pool (99): the batch writes rooms a and b
    whole and c's KV rows, then raises. At one TP rank, each chunk is unpacked again alone: a, b and d
    admitted with their rows bit for bit, c a 500 naming the error, every range freed. Under TP the error
    leaves the poll."""
    q, expected, dst, _, calls, aborted = _staged_poll(monkeypatch, slot_c=99)
    assert q.poll()
    assert [(rid, code) for rid, code, _ in aborted] == [("rid-c", 500)]
    message = aborted[0][2]
    assert "could not be written here (IndexError: " in message and "99 is out of bounds" in message
    assert calls == [[1, 2, 99, 4], [1], [2], [99], [4]] and q.stats["failed_transfers"] == 1
    assert _admitted_bit_for_bit(q, expected, dst, "abd") and expected["c"][0] not in q.sched.running
    assert not q.staged and q.staging.in_use() == 0
    q, *_, aborted = _staged_poll(monkeypatch, tp_size=2, slot_c=99)
    with pytest.raises(IndexError):
        q.poll()
    assert aborted == []


@pytest.mark.parametrize("error", [ValueError, TypeError, KeyError])
def test_under_tp_a_value_error_of_the_unpack_leaves_the_poll(monkeypatch, error):
    """Review of 1f885c6: before it, a ValueError / TypeError / KeyError of a last chunk's unpack under TP
    was caught as "a malformed answer", which left the request in no queue with its range held (never
    answered). The poll now raises it (every TP error of the unpack ends the rank's loop: fbbeca6)."""
    def failing(blocks):
        raise error("a shape that does not fit")

    q, *_, aborted = _staged_poll(monkeypatch, tp_size=2)
    monkeypatch.setattr(q.staging.packer, "unpack_many", failing)
    with pytest.raises(error, match="a shape that does not fit"):
        q.poll()
    assert aborted == []


@pytest.mark.gpu
@_cuda
def test_unpack_many_on_cuda_waits_once_and_holds_one_block_at_a_time():
    """On CUDA: `unpack_many` of four 8 MiB blocks makes one synchronizing call (the copy stream's wait;
    review of 1f885c6, finding 4: `torch.tensor(..., device=cuda)` of the indices waited too), and the
    memory it allocates peaks at one block's device copy (plus the indices: 1 MiB of slack), not four
    (finding 1); the rows land bit for bit."""
    import warnings

    g = torch.Generator().manual_seed(5)
    kv = [torch.randn(4096, 8, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(4)]
    states = [torch.randn(8, 3, 5, generator=g).to("cuda") for _ in range(2)]
    src, tokens = StatePacker(kv, states, "cuda"), 1024  # (8 KiB of KV per token: 8 MiB a block)
    blocks = []
    for i in range(4):
        buf = host_buffer(src.packed_bytes(tokens), pin=True)
        src.pack(list(range(i * tokens, (i + 1) * tokens)), i, buf)
        blocks.append((buf, list(range(4096 - (i + 1) * tokens, 4096 - i * tokens)), 7 - i))
    dst = StatePacker([torch.zeros_like(b) for b in kv], [torch.zeros_like(b) for b in states], "cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            dst.unpack_many(blocks)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    # (torch also warns, once, that the debug mode is a prototype: not a synchronizing call; seen on an
    # H200, 2026-11-29, where the one real synchronize was the only other warning)
    syncs = [w for w in caught if "synchroniz" in str(w.message) and "prototype" not in str(w.message)]
    assert len(syncs) == 1, [str(w.message) for w in syncs]
    assert torch.cuda.max_memory_allocated() - base <= src.packed_bytes(tokens) + (1 << 20)
    for i, (_, rows, slot) in enumerate(blocks):
        sent = slice(i * tokens, (i + 1) * tokens)
        assert all(torch.equal(d[rows], s[sent]) for d, s in zip(dst.kv, kv, strict=True))
        assert all(torch.equal(d[slot], s[i]) for d, s in zip(dst.states, states, strict=True))
