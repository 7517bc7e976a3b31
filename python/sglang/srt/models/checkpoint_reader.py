"""Reading a checkpoint's tensors with the disk read spread over threads.

`safe_open` maps a shard and hands out views of the mapping: nothing is read until the loader copies a
tensor into its parameter, one page fault after another on the loading thread, so a serial load reads
one stream from disk at a time (`benchmark/bench_weight_read.py` measures both). Here a thread pool reads
ahead: each thread reads the bytes of the tensors next in line with `os.preadv` on a plain file
descriptor (no mapping, without the GIL) into a small buffer of its own that it reuses, which brings
them into the page cache; the loader then copies each tensor from its shard's mapping as before, in the
same order (`iter_checkpoint`'s: files sorted, names as each file lists them), so the parameters are the
serial load's, bit for bit.

Memory: what is read ahead lives in the page cache (reclaimable, shared with other ranks reading the
same files, and not the process's: no thread maps a file), and at most `read_ahead` bytes of tensors not
yet handed out are read ahead at once (always at least the next tensor), so a checkpoint larger than the
host's memory loads without the reads evicting each other. The process maps one shard at a time (the
loader's, as the serial load does), and each reading thread holds a BUFFER_BYTES buffer.
"""

from __future__ import annotations

import json
import os
import struct
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sglang.srt.environ import envs
from sglang.srt.models.loader import checkpoint_files, iter_checkpoint

READ_AHEAD_BYTES = 2 << 30
# A tensor bigger than this is read by several threads (an 80B model's embedding is 1.2 GB).
PIECE_BYTES = 64 << 20
BUFFER_BYTES = 4 << 20  # each reading thread's buffer: a piece is read in reads of this many bytes


@dataclass(frozen=True)
class PlannedTensor:
    path: Path
    name: str
    nbytes: int
    offset: int = 0  # where its bytes begin in the file


def plan_checkpoint(folder: str | Path, prefix: str = "") -> list[PlannedTensor]:
    """The tensors `iter_checkpoint(folder, prefix)` yields, in its order, with their sizes in bytes,
    from the files' headers (nothing else is read)."""
    plan = []
    for path in checkpoint_files(folder, prefix):
        spans = _header_spans(path)
        with safe_open(str(path), framework="pt") as f:
            names = [n for n in f.keys() if n.startswith(prefix)]  # noqa: SIM118 - not a mapping
        plan.extend(PlannedTensor(path, n, spans[n][1] - spans[n][0], spans[n][0]) for n in names)
    return plan


def read_checkpoint(
    folder: str | Path, prefix: str = "", threads: int | None = None, read_ahead: int = READ_AHEAD_BYTES
) -> Iterator[tuple[str, torch.Tensor]]:
    """`iter_checkpoint(folder, prefix)`'s tensors, in its order, read ahead by `threads` threads
    (default SGLANG_WEIGHT_READ_THREADS, 8; 1 reads serially), at most `read_ahead` bytes ahead of the
    consumer."""
    threads = envs.SGLANG_WEIGHT_READ_THREADS.get() if threads is None else threads
    if threads <= 1:
        yield from iter_checkpoint(folder, prefix)
        return
    plan = plan_checkpoint(folder, prefix)
    files = _Files()
    pool = ThreadPoolExecutor(threads, thread_name_prefix="weight-read")
    path, f = None, None
    try:
        for i in read_ahead_order(plan, lambda t, a, b: pool.submit(_read, files, t, a, b), read_ahead):
            item = plan[i]
            if item.path != path:
                f = None  # the previous shard's mapping goes before the next one's is made
                path, f = item.path, safe_open(str(item.path), framework="pt")
            yield item.name, f.get_tensor(item.name)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        files.close()


def read_ahead_order(
    plan: list[PlannedTensor], submit: Callable[[PlannedTensor, int, int], Future], read_ahead: int
) -> Iterator[int]:
    """Indices of `plan` in order, each once its reads (`submit(tensor, start, stop)`, byte ranges of
    at most PIECE_BYTES) are done; reads are submitted in plan order while the bytes submitted and not
    yet handed out stay within `read_ahead`, the next tensor's always. A read's error raises here."""
    pending: deque[list[Future]] = deque()
    held = nxt = 0
    for i, item in enumerate(plan):
        while nxt < len(plan) and (nxt == i or held + plan[nxt].nbytes <= read_ahead):
            t = plan[nxt]
            starts = range(0, t.nbytes, PIECE_BYTES) if t.nbytes else ()
            pending.append([submit(t, s, min(s + PIECE_BYTES, t.nbytes)) for s in starts])
            held += t.nbytes
            nxt += 1
        for future in pending.popleft():
            future.result()
        yield i
        held -= item.nbytes


class _Files:
    """The checkpoint's files opened for reading, one descriptor each shared by the threads (`preadv`
    reads at an offset), and each reading thread's buffer."""

    def __init__(self) -> None:
        self._fds: dict[Path, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()

    def fd(self, path: Path) -> int:
        with self._lock:
            if path not in self._fds:
                self._fds[path] = os.open(path, os.O_RDONLY)
            return self._fds[path]

    def buffer(self) -> memoryview:
        if not hasattr(self._local, "buffer"):
            self._local.buffer = memoryview(bytearray(BUFFER_BYTES))
        return self._local.buffer

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()


def _read(files: _Files, item: PlannedTensor, start: int, stop: int) -> None:
    """Read bytes [start, stop) of `item` through the thread's buffer, which leaves them in the page
    cache."""
    fd, buffer = files.fd(item.path), files.buffer()
    pos, end = item.offset + start, item.offset + stop
    while pos < end:
        got = os.preadv(fd, [buffer[: min(BUFFER_BYTES, end - pos)]], pos)
        if got <= 0:
            raise OSError(f"{item.path} ends at byte {pos}, inside tensor {item.name}")
        pos += got


def _header_spans(path: Path) -> dict[str, tuple[int, int]]:
    """Where each tensor of a safetensors file lies, [begin, end) in the file: an 8-byte little-endian
    header length, then a JSON header whose entries hold `data_offsets` [begin, end) from its end."""
    with open(path, "rb") as fh:
        (length,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(length))
    base = 8 + length
    return {
        n: (base + e["data_offsets"][0], base + e["data_offsets"][1])
        for n, e in header.items()
        if n != "__metadata__"
    }
