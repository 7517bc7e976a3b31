"""Staging one request's KV and state through host memory, for pools a transfer engine cannot address.

Mooncake's `-non-cuda` build moves host memory only. With CUDA pools and such a build, a transfer goes
prefill GPU -> pinned host staging buffer -> (transfer engine) -> decode host staging buffer -> decode
GPU. A request is packed into one contiguous block: for every full-attention layer K then V of its
tokens (token-major, in the order of the slot list), then for every linear layer its conv and SSM rows
of one slot, the order of `PoolLayout`. Packing gathers on the device (one `index_select` per buffer,
one `cat`) and copies the block to the host in ONE copy on a copy stream, then waits for that stream
once: no host sync per layer. Unpacking copies the block to the device in one copy and scatters it
(`index_copy_` per buffer) on the copy stream; the forward stream waits for its event before reading.

A request whose KV and state exceed a staging range moves in chunks (`chunk_plan`): the prefill server
packs the next chunk's positions into its buffer (one copy), writes it to the decode server's range,
and tells it (a "chunk" message); the decode server unpacks it into its pools and acknowledges, and
the next chunk follows. The last chunk (and the state, with it when it fits) comes with the "done"
answer. So both buffers have fixed sizes (`staging_sizes`, upstream's environment variables
SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB and SGLANG_DISAGG_STAGING_POOL_SIZE_MB), whatever the context
length.

The same code runs on CPU tensors (no streams, nothing pinned): that is how the packing is tested, and
what `SGLANG_DISAGGREGATION_STAGING=1` runs on CPU pools to exercise the staged protocol end to end.
"""

from __future__ import annotations

import importlib.metadata
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.memory_pool import byte_rows
from sglang.srt.server_args import ServerArgsError

logger = logging.getLogger(__name__)


class StatePacker:
    """Packs and unpacks one request's rows of a server's pools (`kv`: K then V of each full-attention
    layer, rows indexed by token slot; `states`: conv of each linear layer, then SSM of each, rows
    indexed by mamba slot)."""

    def __init__(self, kv: list[torch.Tensor], states: list[torch.Tensor], device: torch.device | str):
        self.kv, self.states = kv, states
        self.device = torch.device(device)
        self.kv_row_bytes = [b[0].nbytes for b in kv]
        self.state_bytes = [b[0].nbytes for b in states]
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @classmethod
    def of(cls, token_to_kv_pool, mamba_pool, device: str) -> StatePacker:
        states = [layer for buf in (mamba_pool.conv_state, mamba_pool.ssm_state) for layer in buf]
        return cls(kv_buffers(token_to_kv_pool), states, device)

    def clear(self, tokens: list[int], slot: int) -> None:
        """Zero the rows of `tokens` and of `slot`: `clear_many` of one destination."""
        self.clear_many([(tokens, slot)])

    def clear_many(self, destinations: list[tuple[list[int], int]]) -> None:
        """Zero the rows of each destination's tokens and slot (device memory: no host address to memset),
        every destination in one op per buffer. Done when this returns (on CUDA: on the copy stream, waited
        for ONCE, whatever the number of destinations), so that the transfers, which the caller asks for
        next and which write straight into these rows, land after the zeros."""
        try:
            with _on(self.stream):
                tokens = [t for dst_tokens, _ in destinations for t in dst_tokens]
                idx = torch.tensor(tokens, dtype=torch.int64, device=self.device)
                slots = torch.tensor([slot for _, slot in destinations], dtype=torch.int64, device=self.device)
                for buf in self.kv:
                    byte_rows(buf).index_fill_(0, idx, 0)
                for buf in self.states:
                    byte_rows(buf).index_fill_(0, slots, 0)
        finally:
            self._sync()

    def _sync(self) -> None:
        """Wait for the copy stream (CPU: nothing to wait for). `pack`, `unpack` and `clear_many` do so also
        when they raise: what they queued before the error has landed before their caller frees (and
        another request reuses) the rows or the host range."""
        if self.stream is not None:
            self.stream.synchronize()

    def packed_bytes(self, num_tokens: int, state: bool = True) -> int:
        return num_tokens * sum(self.kv_row_bytes) + (sum(self.state_bytes) if state else 0)

    def pack(self, tokens: list[int], slot: int | None, out: torch.Tensor) -> int:
        """Write the rows of `tokens` and of `slot` (None: no state) into the host uint8 tensor `out`;
        returns the bytes written. Blocks until the bytes are on the host (one wait per chunk)."""
        n = self.packed_bytes(len(tokens), slot is not None)
        try:
            with _on(self.stream):
                idx = torch.tensor(tokens, dtype=torch.int64, device=self.device)
                parts = [_bytes(byte_rows(b).index_select(0, idx)) for b in self.kv]
                if slot is not None:
                    parts += [_bytes(b[slot : slot + 1]) for b in self.states]
                out[:n].copy_(torch.cat(parts) if parts else out[:0], non_blocking=self.stream is not None)
        finally:
            self._sync()
        return n

    def unpack(self, src: torch.Tensor, tokens: list[int], slot: int | None) -> None:
        """Scatter a block `pack` wrote (host uint8 tensor) into the rows of `tokens` and `slot` (None: the
        block has no state). On CUDA it waits for the copy stream once (the host range is free for the
        next chunk after it)."""
        n = self.packed_bytes(len(tokens), slot is not None)
        try:
            with _on(self.stream):
                block = src[:n].to(self.device, non_blocking=self.stream is not None)
                idx = torch.tensor(tokens, dtype=torch.int64, device=self.device)
                at = 0
                for buf, row in zip(self.kv, self.kv_row_bytes, strict=True):
                    size = row * len(tokens)
                    rows = _as(block[at : at + size], buf.dtype).view(len(tokens), *buf.shape[1:])
                    byte_rows(buf).index_copy_(0, idx, byte_rows(rows))
                    at += size
                for buf, size in zip(self.states, self.state_bytes, strict=True):
                    if slot is None:
                        break
                    buf[slot].copy_(_as(block[at : at + size], buf.dtype).view(buf.shape[1:]))
                    at += size
        finally:
            self._sync()  # (the host range is reused by the next transfer once this returns)


def kv_buffers(token_to_kv_pool) -> list[torch.Tensor]:
    """A KV pool's buffers in the order both servers move them: K then V of each full-attention layer."""
    return [b for pair in zip(token_to_kv_pool.k_buffer, token_to_kv_pool.v_buffer, strict=True) for b in pair]


def _as(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A packed part's bytes as `dtype`. Parts follow each other unpadded, so one after a part of another
    dtype may start off its element size (a bf16 conv state of odd size, then a float32 SSM state), where
    a view is refused: such a part is copied to a fresh (aligned) tensor first."""
    if part.storage_offset() % dtype.itemsize:
        part = part.clone()
    return part.view(dtype)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


class _on:
    """`torch.cuda.stream(s)`, or nothing for CPU tensors."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A host byte buffer a transfer engine can register (pinned when the pools are on CUDA, so that the
    copies to and from the device are asynchronous)."""
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)


class ByteRanges:
    """First-fit ranges of a staging buffer, one per request in flight (the decode side reserves one
    with each destination; a request waits for room as it waits for KV slots)."""

    def __init__(self, size: int, align: int = 1):
        self.size = size
        self.align = align
        self.used: dict[int, int] = {}  # start -> length

    def alloc(self, n: int) -> int | None:
        n = max(n, 1)  # (two empty ranges must not share a start)
        n = -(-n // self.align) * self.align  # every start aligned
        at = 0
        for start in sorted(self.used):
            if start - at >= n:
                break  # the gap before this range fits
            at = start + self.used[start]
        else:
            if self.size - at < n:
                return None
        self.used[at] = n
        return at

    def free(self, start: int) -> None:
        del self.used[start]


def mooncake_moves_gpu_memory() -> bool:
    """Whether the installed Mooncake is its CUDA build (`mooncake-transfer-engine`), which registers
    and moves device memory; the `-non-cuda` build moves host memory only."""
    try:
        importlib.metadata.version("mooncake-transfer-engine")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def transfer_path(device: str, backend: str = "mooncake") -> str:
    """How this server's pools are transferred: "host" (CPU pools, registered as they are), "gpu" (CUDA
    pools registered directly: Mooncake's CUDA build) or "staged" (through host staging buffers: CUDA
    pools with a host-only Mooncake or with NIXL, whose device memory path is not verified here, or
    SGLANG_DISAGGREGATION_STAGING=1)."""
    if envs.SGLANG_DISAGGREGATION_STAGING.get():
        return "staged"
    if device == "cpu":
        return "host"
    return "gpu" if backend == "mooncake" and mooncake_moves_gpu_memory() else "staged"


MIB = 1 << 20
# Staging ranges start on this many bytes (rows are viewed as their dtype in place on CPU, and DMA likes
# aligned host addresses); chunks and the decode buffer are sized in multiples of it.
ALIGN = 256


def _round_down(n: int) -> int:
    return n // ALIGN * ALIGN


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def staging_sizes(side: str, packer: StatePacker, context_len: int, request_rows: int) -> tuple[int, int]:
    """(buffer bytes, chunk bytes) of a server's staging buffer. The chunk (the most one request moves
    through a staging range at once) is SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB; the prefill server's buffer
    is one chunk (its transfers run one at a time), the decode server's SGLANG_DISAGG_STAGING_POOL_SIZE_MB
    (a range per request in flight). Neither is larger than it can ever use: a whole prompt of the
    context length per chunk, a chunk per request row on the decode side."""
    chunk_env = envs.SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB
    pool_env = envs.SGLANG_DISAGG_STAGING_POOL_SIZE_MB
    # One position's KV and the state (a chunk holds at least either), in whole ALIGN-byte units: the
    # chunk is a multiple of ALIGN, so that a range of at most a chunk, rounded up to ALIGN, still fits it.
    least = _round_up(packer.packed_bytes(1))
    chunk = _round_down(int(chunk_env.get() * MIB))
    if chunk < least:
        raise ServerArgsError(
            f"SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB={chunk_env.get():g} is below one prompt position's KV and "
            f"one request's state ({least / MIB:.4f} MiB, aligned), the least a staging chunk must hold."
        )
    chunk = min(chunk, _round_up(packer.packed_bytes(context_len)))
    if side == "prefill":
        return chunk, chunk
    pool = int(pool_env.get() * MIB)
    if pool < chunk:
        raise ServerArgsError(
            f"SGLANG_DISAGG_STAGING_POOL_SIZE_MB={pool_env.get():g} is below one staging chunk "
            f"({chunk / MIB:.4f} MiB, SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB or a whole prompt)."
        )
    # Whole chunks: a range never exceeds one, so with every range freed the next request always fits.
    return min(pool // chunk, request_rows) * chunk, chunk


def chunk_plan(num_tokens: int, token_bytes: int, state_bytes: int, cap: int) -> list[tuple[int, int, bool]]:
    """How `num_tokens` positions of KV (`token_bytes` each) and one state move through a staging range
    of `cap` bytes: (first position, end, whether the state comes with it) per chunk, in order. A chunk
    holds as many whole positions as fit; the state rides with the last one where it fits, else alone
    after it."""
    if cap < max(token_bytes, state_bytes, 1):
        raise ValueError(f"a staging range of {cap} bytes holds neither a position ({token_bytes} bytes) nor "
                         f"the state ({state_bytes} bytes)")  # fmt: skip
    per = cap // token_bytes if token_bytes else max(num_tokens, 1)
    chunks = [(a, min(a + per, num_tokens), False) for a in range(0, num_tokens, per)]
    if chunks and (chunks[-1][1] - chunks[-1][0]) * token_bytes + state_bytes <= cap:
        chunks[-1] = (chunks[-1][0], chunks[-1][1], True)
    else:
        chunks.append((num_tokens, num_tokens, True))
    return chunks


@dataclass
class StagedRange:
    """The decode side's range of its staging buffer for one request, and what has arrived in it: the
    prompt's positions past `prefix` are received in order, the state once, last."""

    req: Any
    start: int
    length: int
    prefix: int
    received: int = 0  # positions past the prefix unpacked so far
    state: bool = False

    def tokens(self) -> list[int]:
        return self.req.kv_indices[self.prefix : len(self.req.origin_input_ids)]

    def complete(self) -> bool:
        return self.state and self.received == len(self.req.origin_input_ids) - self.prefix


# How often a staged transfer's thread looks at its scheduler's polls while it waits for an acknowledgement.
ACK_POLL_S = 0.05
# The wait counts while the scheduler polled at most this long ago (an idle loop polls every ~50-100 ms,
# under TP at the pace of its exchange; a longer gap is a pause, or a long step, which do not count).
PAUSED_AFTER_S = 1.0


class ChunkLink:
    """One staged transfer's link between the prefill server's transfer thread and its scheduler thread
    (which owns the sockets): the thread posts each chunk it wrote for the scheduler to announce, and
    waits for the decode server's acknowledgement, which the scheduler passes on, or for a cancel. The
    scheduler's polls beat (`heartbeat`): the wait for an acknowledgement counts only the time while they
    do, so that a pause of this server (no polls: e.g. `/pause_generation` for a weight sync) fails no
    transfer in flight."""

    def __init__(self, cancelled: threading.Event | None = None):
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        self.acks: queue.SimpleQueue = queue.SimpleQueue()
        # (the room's own flag: `prefill._Room.cancel`)
        self.cancelled = cancelled if cancelled is not None else threading.Event()
        self.beat = float("-inf")  # the scheduler's last poll (its clock)

    def drain(self) -> list[list]:
        out = []
        while True:
            try:
                out.append(self.outbox.get_nowait())
            except queue.Empty:
                return out

    def heartbeat(self) -> None:
        self.beat = time.monotonic()

    def ack(self, chunk: Any) -> None:
        self.acks.put(chunk)

    def cancel(self) -> None:
        self.cancelled.set()
        self.acks.put(None)

    def wait_ack(self, chunk: list, timeout: float) -> None:
        waited, since = 0.0, time.monotonic()
        while not self.cancelled.is_set():
            try:
                got = self.acks.get(timeout=ACK_POLL_S)
            except queue.Empty:
                got = None
            now = time.monotonic()
            if now - self.beat <= PAUSED_AFTER_S:  # the scheduler polls: this server is not paused
                waited += now - since
            since = now
            if got == chunk:
                return
            if waited > timeout and not self.cancelled.is_set():
                raise RuntimeError(
                    f"the decode server did not acknowledge a staged chunk within {timeout:g} s"
                )
        raise RuntimeError("cancelled by the decode server")


@dataclass
class Staging:
    """A server's staging buffer (registered with the transfer engine instead of its pools), the packing
    of its pools' rows, and the chunk: the most one request moves through a range at once."""

    packer: StatePacker
    buffer: torch.Tensor
    ranges: ByteRanges
    chunk_bytes: int
    # Decode side: freed ranges being zeroed off the scheduler's thread (still held in `ranges`).
    zeroing: list[tuple[int, Future]] = field(default_factory=list)
    zeroer: ThreadPoolExecutor | None = None
    # Decode side: a chunk whose unpack raises fails its own request (at --tp-size 1), or ends this rank's
    # scheduler loop (under TP: `receive`).
    fail_alone: bool = True

    @classmethod
    def create(cls, packer: StatePacker, nbytes: int, chunk_bytes: int, tp_size: int = 1) -> Staging:
        buffer = host_buffer(nbytes, pin=packer.device.type == "cuda")
        return cls(packer, buffer, ByteRanges(nbytes, align=ALIGN), chunk_bytes, fail_alone=tp_size == 1)

    def alloc(self, nbytes: int) -> int | None:
        """Decode side: a range of `nbytes`, all zeros (a chunk's unpack may read bytes the prefill server
        has not written in it: never another request's), or None. The ranges being zeroed are taken back
        only when nothing else fits, all at once, after their zeroing: so under TP every rank (whose zeroing
        threads run at their own pace) finds the same ranges free and picks the same start."""
        start = self.ranges.alloc(nbytes)
        if start is None and self.zeroing:
            for at, done in self.zeroing:
                done.result()
                self.ranges.free(at)
            self.zeroing = []
            start = self.ranges.alloc(nbytes)
        return start

    def free(self, start: int) -> None:
        """Decode side: give a range back once nothing writes it any more; it is zeroed on a thread of its
        own (up to a chunk: ~9 ms for 256 MiB, not on the scheduler's loop)."""
        if self.zeroer is None:
            self.zeroer = ThreadPoolExecutor(1, thread_name_prefix="staging-zero")
        view = self.buffer[start : start + self.ranges.used[start]]
        self.zeroing.append((start, self.zeroer.submit(view.zero_)))

    def in_use(self) -> int:
        return len(self.ranges.used) - len(self.zeroing)

    def address(self, start: int) -> int:
        return self.buffer.data_ptr() + start

    def range_bytes(self, num_tokens: int) -> int:
        """Decode side: the range a request of `num_tokens` positions to receive gets."""
        return min(self.packer.packed_bytes(num_tokens), self.chunk_bytes)

    def send(
        self,
        write: Callable[[str, list[tuple[int, int, int]]], None],
        session: str,
        tokens: list[int],
        slot: int,
        dst: tuple[int, int],
        link: ChunkLink,
        ack_timeout: float,
    ) -> tuple[int, list]:
        """Prefill side, on the transfer thread: move the rows of `tokens` and `slot` into the decode
        server's range `dst` (address, bytes) chunk by chunk, each packed in one copy and written as one
        block, the next only after the decode server acknowledged the last. The final chunk is not
        acknowledged: it goes with the "done" answer. Returns the bytes moved and that chunk."""
        packer = self.packer
        plan = chunk_plan(len(tokens), sum(packer.kv_row_bytes), sum(packer.state_bytes),
                          min(dst[1], self.buffer.nbytes))  # fmt: skip
        total = 0
        for i, (a, b, state) in enumerate(plan):
            if link.cancelled.is_set():  # (before each write: the decode side may reuse the range)
                raise RuntimeError("cancelled by the decode server")
            n = packer.pack(tokens[a:b], slot if state else None, self.buffer)
            write(session, [(self.address(0), dst[0], n)])
            total += n
            if i == len(plan) - 1:
                return total, [a, b, state]
            link.outbox.put([a, b, state])
            link.wait_ack([a, b, state], ack_timeout)
        raise AssertionError("a chunk plan is never empty")

    def receive(self, entry: StagedRange, chunk: Any) -> str | None:
        """Decode side: unpack a chunk the prefill server wrote into `entry`'s range (`chunk`: [start,
        end, with state] from its message: the next positions in order, within the prompt and the range);
        why it is refused, or None. A chunk the pools cannot take (the unpack raises) is refused at one TP
        rank; under TP the error is raised (`fail_alone`): it may be this rank's alone (a CUDA out of memory
        on one GPU), and failing the request here while the other ranks admit it would leave their
        schedulers running different batches (collectives of other shapes: wrong tokens or a hang), so
        this rank's loop ends, visibly, as every rank's did before the refusal was added."""
        tokens = entry.tokens()
        ok = isinstance(chunk, list) and len(chunk) == 3 and isinstance(chunk[2], bool)
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in chunk[:2])
        if ok:
            a, b, state = chunk
            ok = a == entry.received and a <= b <= len(tokens) and (a < b or state) and not entry.state
            ok = ok and (not state or b == len(tokens))
            ok = ok and self.packer.packed_bytes(b - a, state) <= entry.length
        if not ok:
            return (f"a staged chunk {str(chunk)[:64]} that is not the next part of the prompt's "
                    f"{len(tokens)} positions ({entry.received} received) within its {entry.length}-byte range")  # fmt: skip
        req = entry.req
        try:  # a chunk that cannot be written fails its own request, never the decode server's loop
            self.packer.unpack(self.buffer[entry.start :], tokens[a:b], req.mamba_pool_idx if state else None)
        except Exception as e:  # noqa: BLE001 - logged whole: it is a defect here, not the peer's
            if not self.fail_alone:
                raise
            logger.exception("Unpacking staged chunk %s of request %s failed.", chunk, req.rid)
            return f"its staged chunk {chunk} could not be written here ({type(e).__name__}: {str(e)[:200]})"
        entry.received, entry.state = b, state
        return None
