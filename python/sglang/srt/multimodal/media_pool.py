"""The threads that read, decode and process requests' media items: a pool of their own (not the event
loop's default executor, which tokenization shares), taken by the requests in turn, and dropped with
their client.

- `MEDIA_THREADS` threads serve every request; a request runs one item at a time (`MediaJob.run`), so the
  pool's first-in-first-out queue takes the requests in turn: a request of 32 images holds one thread, and
  another request's image waits for one item of each request ahead of it, not for all their items.
- A job ends (`MediaCancelled`) when its HTTP client goes away (asked before each item and every `POLL_S`
  while one waits or runs) or its task is cancelled: an item still queued is dropped from the queue, and no
  later item is submitted. An item already running sees it through `check_cancelled` (a video between two
  frames or packets stops there, an image between its decode, resize and processing); an image's decode
  runs to its end (PIL cannot be interrupted), which the per-image bound (`media_io.PixelBudget`) keeps
  short.
- The decoded bytes all items hold at once are bounded for the process (`MediaMemory`,
  SGLANG_MEDIA_MEMORY_MB): an item states what it may hold (from its header, before it is decoded) and waits,
  without a thread, until that fits beside the items running; waiters are admitted first come first served,
  and a request has one item waiting at a time, so the requests are admitted in turn; a small item (an
  image) may pass a large one within a slice of the budget large items never take, so a large video
  waiting for room (or one larger than the budget, charged as the budget less that slice) does not hold
  up other requests' images.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

# Threads decoding and processing media, over all requests: at most the cores (each item is CPU work, and
# the decoded image each holds is bounded per item), at most 4 (the HTTP process also serves the loop).
MEDIA_THREADS = max(1, min(4, os.cpu_count() or 1))
# How often a job waiting on an item asks whether its client is still there.
POLL_S = 0.5
THREAD_PREFIX = "media-decode"
# The decoded bytes the media items running at once may hold, over all requests (the estimates of
# `media_io.image_bytes` and `video.video_bytes`): SGLANG_MEDIA_MEMORY_MB (environ.py), default 2 GiB.
# Without it the threads could hold MEDIA_THREADS x the largest item at once (a 200 KB H.264 file of
# 8192x8192 frames with 16 reference frames held ~2.9 GB while it decoded).
MEMORY_ENV = "SGLANG_MEDIA_MEMORY_MB"
# An item that reserved at least this much gives the heap's free memory back to the system when it ends
# (glibc's malloc_trim): the decoder's frames (under glibc's 32 MB mmap threshold) are freed into the
# thread's own arena, which keeps them, so the process grew by each thread's largest item even while the
# budget let fewer run at once (4 threads, 4096x4096 videos, a budget of two: +2.6 GB without, measured).
TRIM_BYTES = 64 << 20

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_memory: MediaMemory | None = None
# The job whose item this media thread runs (check_cancelled).
_current = threading.local()


def media_threads() -> ThreadPoolExecutor:
    """The process's media pool (made at first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix=THREAD_PREFIX)
        return _pool


def media_memory() -> MediaMemory:
    """The process's decoded-bytes budget (made at first use, from SGLANG_MEDIA_MEMORY_MB)."""
    global _memory
    with _pool_lock:
        if _memory is None:
            _memory = MediaMemory(memory_limit())
        return _memory


def memory_limit() -> int:
    """The budget in bytes: SGLANG_MEDIA_MEMORY_MB (a positive whole number of MiB; default 2048)."""
    from sglang.srt.environ import envs

    mb = envs.SGLANG_MEDIA_MEMORY_MB.get()  # ValueError naming the variable for a non-integer
    if mb < 1:
        raise ValueError(f"{MEMORY_ENV} must be a positive whole number of MiB, got {mb}.")
    return mb << 20


class MediaMemory:
    """Decoded bytes in flight over the process: `acquire(n)` waits until `n` fits beside what the
    running items hold, `release(n)` gives them back. Thread-safe, usable from any event loop.

    Large items (over `small`: limit / 32, 64 MiB of the default 2 GiB) are admitted first come first
    served within `limit - reserved` (the reserved slice: limit / 8); one over that is charged that much
    and runs beside small items only (the process may then hold it and the slice). Small items (images)
    take any room, and while a larger item waits they may pass it within the reserved slice: a 200 KB
    video of 8192x8192 frames made a bystander's 64x64 image wait 5.6 s behind it while it waited for
    the budget to empty and then ran alone. Small items cannot starve a large one: past it, they take
    only the slice, which large items never use."""

    def __init__(self, limit: int):
        self.limit = limit
        self.small = limit // 32
        self.reserved = limit // 8
        self.used = 0
        self._large = 0  # of `used`, held by large items (at most limit - reserved)
        self.peak = 0  # the most held at once (what a test or a benchmark reads)
        self._lock = threading.Lock()
        self._waiters: deque[list] = deque()  # [bytes, future, loop, granted]

    def charge(self, n: int) -> int:
        """What an item of `n` bytes counts against the budget."""
        return n if n <= self.small else min(n, self.limit - self.reserved)

    def _fits(self, n: int, passing: bool) -> bool:
        """Whether `n` fits now; `passing`: it would pass a waiter ahead of it (small items only)."""
        c = self.charge(n)
        if n <= self.small:
            if passing:
                return self.used - self._large + c <= self.reserved
            return self.used + c <= self.limit
        return self.used + c <= self.limit and self._large + c <= self.limit - self.reserved

    def _take(self, n: int) -> None:
        c = self.charge(n)
        self.used += c
        if n > self.small:
            self._large += c
        self.peak = max(self.peak, self.used)

    async def acquire(self, n: int, poll: Callable[[], Any] | None = None) -> None:
        """Wait for `n` bytes; `poll` (a coroutine function) is awaited every POLL_S while waiting and
        may raise to give up (the client gone): nothing is then held."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if not self._waiters and self._fits(n, False):
                self._take(n)
                return
            if n <= self.small and all(w[0] > self.small for w in self._waiters) and self._fits(n, True):
                self._take(n)  # past the large items waiting, within the reserved slice
                return
            entry = [n, loop.create_future(), loop, False]
            self._waiters.append(entry)
        try:
            while True:
                done, _ = await asyncio.wait({entry[1]}, timeout=POLL_S)
                if done:
                    return
                if poll is not None:
                    await poll()
        except BaseException:
            with self._lock:
                granted = entry[3]
                if not granted and entry in self._waiters:  # (the queue may be gone at shutdown)
                    self._waiters.remove(entry)
            if granted:
                self.release(n)
            else:
                self._wake()  # the head of the queue may have changed
            raise

    def release(self, n: int) -> None:
        with self._lock:
            c = self.charge(n)
            self.used -= c
            if n > self.small:
                self._large -= c
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            # the queue's head in order, then small waiters past it within the reserved slice (in order
            # among themselves: the first that does not fit stops them)
            passing = False
            for entry in list(self._waiters):
                n = entry[0]
                if n > self.small and (passing or not self._fits(n, False)):
                    passing = True  # large items keep their order: none passes this one
                    continue
                if n <= self.small and not self._fits(n, passing):
                    break
                self._waiters.remove(entry)
                try:
                    entry[2].call_soon_threadsafe(_grant, entry[1])
                except RuntimeError:  # its loop is closed (the process ends): nobody waits there
                    continue
                entry[3] = True
                self._take(n)


def _grant(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _Hold:
    """An item's reserved bytes, given back once: when its work ends, or when it is dropped unstarted."""

    def __init__(self, memory: MediaMemory | None, n: int):
        self.memory, self.n = memory, n
        self._lock = threading.Lock()
        self._state = "reserved"  # -> "started" -> "done", or -> "done" (dropped unstarted)

    def start(self) -> bool:
        with self._lock:
            if self._state != "reserved":
                return False
            self._state = "started"
            return True

    def finish(self, unstarted_only: bool = False) -> None:
        with self._lock:
            if self._state == "done" or (unstarted_only and self._state == "started"):
                return
            self._state = "done"
        if self.memory is not None and self.n:
            self.memory.release(self.n)


def _trim() -> None:
    """Give the heaps' free memory back to the system (glibc only; elsewhere nothing)."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def check_cancelled() -> None:
    """In a media thread: MediaCancelled once the job of the item it runs has ended (its client left).
    A long item (a video's frames) asks between steps."""
    job = getattr(_current, "job", None)
    if job is not None and job.cancelled.is_set():
        raise MediaCancelled()


class DisconnectCheck(Protocol):
    async def is_disconnected(self) -> bool: ...


class MediaCancelled(Exception):
    """The request's client went away (or its task was cancelled): its remaining media items were
    dropped."""


class MediaJob:
    """One request's media work: its items run one at a time in the media pool, until its client leaves.
    `request`: the HTTP request (None: an in-process caller, never disconnected)."""

    def __init__(self, request: DisconnectCheck | None = None):
        self.request = request
        self.cancelled = threading.Event()
        self._turn: asyncio.Lock | None = None

    async def run(self, fn: Callable[..., Any], *args: Any, reserve: int = 0) -> Any:
        """`fn(*args)` in the media pool, after this job's earlier items; MediaCancelled once the client
        is gone (the item is not started if it is still queued then). `reserve`: the decoded bytes the
        item may hold, waited for in the process's `MediaMemory` before it is queued, held until it ends."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:
            await self._check()
            memory = media_memory() if reserve else None
            if memory is not None:
                try:
                    await memory.acquire(reserve, self._check)
                except BaseException:
                    self.cancelled.set()
                    raise
            hold = _Hold(memory, reserve)
            fut = asyncio.get_running_loop().run_in_executor(media_threads(), self._call, hold, fn, args)
            try:
                while True:
                    done, _ = await asyncio.wait({fut}, timeout=POLL_S)
                    if done:
                        return fut.result()
                    await self._check()
            except BaseException:
                self.cancelled.set()
                fut.cancel()  # still queued: never runs; running: its result is dropped
                hold.finish(unstarted_only=True)  # a running item gives its bytes back when it stops
                raise

    def _call(self, hold: _Hold, fn: Callable[..., Any], args: tuple) -> Any:
        if not hold.start():  # dropped while queued
            raise MediaCancelled()
        _current.job = self
        try:
            if self.cancelled.is_set():  # the client left while this item was queued
                raise MediaCancelled()
            return fn(*args)
        finally:
            _current.job = None
            hold.finish()
            if hold.n >= TRIM_BYTES:
                _trim()

    async def _check(self) -> None:
        if not self.cancelled.is_set() and self.request is not None and await self.request.is_disconnected():
            self.cancelled.set()
        if self.cancelled.is_set():
            raise MediaCancelled()
