"""Staging one request's KV and state through host memory, for pools a transfer engine cannot address.

Mooncake's `-non-cuda` build moves host memory only. With CUDA pools and such a build, a transfer goes
prefill GPU -> pinned host staging buffer -> (transfer engine) -> decode host staging buffer -> decode
GPU. A request is packed into one contiguous block, and unpacked from it, by `StatePacker`
(`state_packer.py`: one copy and one copy-stream wait per block packed; one wait per batch of blocks
unpacked).

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
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.disaggregation.state_packer import StatePacker

if TYPE_CHECKING:
    from sglang.srt.disaggregation.staged_route import StagedRoute
from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgsError

logger = logging.getLogger(__name__)


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
    return chunk_plan_within(num_tokens, [(token_bytes, state_bytes, cap)])


def chunk_plan_within(num_tokens: int, sides: list[tuple[int, int, int]]) -> list[tuple[int, int, bool]]:
    """`chunk_plan` where each chunk must fit every one of `sides`, (token bytes, state bytes, cap) each:
    between servers of other --tp-size sizes a position weighs otherwise in the prefill rank's buffer and
    in each decode rank's range (`staged_route.py`)."""
    for token_bytes, state_bytes, cap in sides:
        if cap < max(token_bytes, state_bytes, 1):
            raise ValueError(f"a staging range of {cap} bytes holds neither a position ({token_bytes} bytes) "
                             f"nor the state ({state_bytes} bytes)")  # fmt: skip
    per = min((cap // token for token, _, cap in sides if token), default=max(num_tokens, 1))
    chunks = [(a, min(a + per, num_tokens), False) for a in range(0, num_tokens, per)]
    if chunks and all((chunks[-1][1] - chunks[-1][0]) * token + state <= cap for token, state, cap in sides):
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
# A batch unpack that raised (its chunks then unpacked alone) is logged at most this often.
BATCH_WARN_EVERY_S = 60.0


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
    # Decode side: when a batch unpack that raised was last logged (`_warn_batch`), and how many since.
    batch_warned: float = float("-inf")
    batch_failures: int = 0

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
        route: StagedRoute,
        tokens: list[int],
        slot: int,
        link: ChunkLink,
        ack_timeout: float,
    ) -> tuple[int, list]:
        """Prefill side, on the transfer thread: move the rows of `tokens` and `slot` into the decode
        server's range(s) (`route`: at the same --tp-size the range of the decode rank of the same index)
        chunk by chunk, each packed in one copy and written as one block (as the parts of the decode ranks'
        blocks this rank holds, at another --tp-size), the next only after the decode server acknowledged
        the last. The final chunk is not acknowledged: it goes with the "done" answer. Returns the bytes
        moved and that chunk."""
        packer = self.packer
        own = (sum(packer.kv_row_bytes), sum(packer.state_bytes), self.buffer.nbytes)
        plan = chunk_plan_within(len(tokens), route.sides(own))
        total = 0
        for i, (a, b, state) in enumerate(plan):
            if link.cancelled.is_set():  # (before each write: the decode side may reuse the range)
                raise RuntimeError("cancelled by the decode server")
            n = packer.pack(tokens[a:b], slot if state else None, self.buffer)
            for session, descriptors in route.writes(self.address(0), b - a, n, state):
                write(session, descriptors)
                total += sum(k for _, _, k in descriptors)
            if i == len(plan) - 1:
                return total, [a, b, state]
            link.outbox.put([a, b, state])
            link.wait_ack([a, b, state], ack_timeout)
        raise AssertionError("a chunk plan is never empty")

    def receive(self, entry: StagedRange, chunk: Any) -> str | None:
        """Decode side: unpack a chunk the prefill server wrote into `entry`'s range; why it is refused, or
        None (`receive_many` of one)."""
        return self.receive_many([(entry, chunk)])[0]

    def refusal(self, entry: StagedRange, chunk: Any) -> str | None:
        """Why `chunk` ([start, end, with state] from its message) is not the next part of `entry`'s prompt
        (positions in order, within the prompt and the range, the state once, last), or None."""
        tokens = entry.tokens()
        ok = isinstance(chunk, list) and len(chunk) == 3 and isinstance(chunk[2], bool)
        ok = ok and all(isinstance(v, int) and not isinstance(v, bool) for v in chunk[:2])
        if ok:
            a, b, state = chunk
            ok = a == entry.received and a <= b <= len(tokens) and (a < b or state) and not entry.state
            ok = ok and (not state or b == len(tokens))
            ok = ok and self.packer.packed_bytes(b - a, state) <= entry.length
        if ok:
            return None
        return (f"a staged chunk {str(chunk)[:64]} that is not the next part of the prompt's "
                f"{len(tokens)} positions ({entry.received} received) within its {entry.length}-byte range")  # fmt: skip

    def receive_many(self, chunks: list[tuple[StagedRange, Any]]) -> list[str | None]:
        """Decode side: unpack chunks the prefill servers wrote into their requests' ranges, one per range,
        in one `unpack_many` (one copy-stream wait); for each, why it is refused (`refusal`), or None. A
        chunk the pools cannot take (the unpack raises) is refused at one TP rank (after a batch that
        raised, each of its chunks is unpacked again alone: only those that raise then are refused); under
        TP the error is raised (`fail_alone`): it may be this rank's alone (a CUDA out of memory on one
        GPU), and failing the request here while the other ranks admit it would leave their schedulers
        running different batches (collectives of other shapes: wrong tokens or a hang), so this rank's
        loop ends, visibly, as every rank's did before the refusal was added."""
        errors = [self.refusal(entry, chunk) for entry, chunk in chunks]
        todo = [i for i, error in enumerate(errors) if error is None]
        blocks = [self._block(*chunks[i]) for i in todo]  # (host bytes, rows, state slot) of each to unpack
        if len(todo) == 1:
            errors[todo[0]] = self._unpack_alone(*chunks[todo[0]], blocks[0])
        elif todo:
            batch_error = None
            try:
                self.packer.unpack_many(blocks)
            except Exception as e:  # noqa: BLE001 - each chunk is unpacked again alone to find the cause
                if not self.fail_alone:
                    raise
                batch_error = f"{type(e).__name__}: {str(e)[:200]}"
            # (the retries run after the except block: in it, the exception's traceback would keep the
            # batch's frames, and the device copy they hold, alive through them: an out-of-memory retried
            # with the memory that ran out still taken)
            if batch_error is not None:
                for i, block in zip(todo, blocks, strict=True):
                    errors[i] = self._unpack_alone(*chunks[i], block)
                self._warn_batch(len(todo), sum(errors[i] is not None for i in todo), batch_error)
        for (entry, chunk), error in zip(chunks, errors, strict=True):
            if error is None:
                entry.received, entry.state = chunk[1], chunk[2]
        return errors

    def _block(self, entry: StagedRange, chunk: list) -> tuple[torch.Tensor, list[int], int | None]:
        a, b, state = chunk
        return self.buffer[entry.start :], entry.tokens()[a:b], entry.req.mamba_pool_idx if state else None

    def _unpack_alone(self, entry: StagedRange, chunk: list, block: tuple) -> str | None:
        """Unpack one chunk's block; why it could not be written (logged with its traceback), or None.
        Under TP the error is raised (`receive_many`)."""
        try:  # a chunk that cannot be written fails its own request, never the decode server's loop
            self.packer.unpack_many([block])
        except Exception as e:  # noqa: BLE001 - logged whole: it is a defect here, not the peer's
            if not self.fail_alone:
                raise
            logger.error("Unpacking staged chunk %s of request %s failed.", chunk, entry.req.rid, exc_info=e)
            return f"its staged chunk {chunk} could not be written here ({type(e).__name__}: {str(e)[:200]})"
        return None

    def _warn_batch(self, blocks: int, failed: int, error: str) -> None:
        """Log a batch unpack that raised (every `BATCH_WARN_EVERY_S` at most, with the count since): where
        each chunk then went in alone, nothing else would say that it happened (an out-of-memory of the
        batch, or a defect of the batch itself)."""
        self.batch_failures += 1
        now = time.monotonic()
        if now - self.batch_warned < BATCH_WARN_EVERY_S:
            return
        logger.warning("Unpacking %d staged chunks together failed (%s); each was unpacked again alone, "
                       "%d of them failed (%d such batch failures since the last warning).",
                       blocks, error, failed, self.batch_failures)  # fmt: skip
        self.batch_warned, self.batch_failures = now, 0
