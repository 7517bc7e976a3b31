"""The threads that read, decode and process requests' media items: a pool of their own (not the event
loop's default executor, which tokenization shares), taken by the requests in turn, and dropped with
their client.

- `MEDIA_THREADS` threads serve every request; a request runs one item at a time (`MediaJob.run`), so the
  pool's first-in-first-out queue takes the requests in turn: a request of 32 images holds one thread, and
  another request's image waits for one item of each request ahead of it, not for all their items.
- A job ends (`MediaCancelled`) when its HTTP client goes away (asked before each item and every `POLL_S`
  while one waits or runs) or its task is cancelled: an item still queued is dropped from the queue, and no
  later item is submitted. An item already decoding runs to its end (PIL cannot be interrupted); the
  per-image bound (`media_io.PixelBudget`) keeps that short.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

# Threads decoding and processing media, over all requests: at most the cores (each item is CPU work, and
# the decoded image each holds is bounded per item), at most 4 (the HTTP process also serves the loop).
MEDIA_THREADS = max(1, min(4, os.cpu_count() or 1))
# How often a job waiting on an item asks whether its client is still there.
POLL_S = 0.5
THREAD_PREFIX = "media-decode"

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def media_threads() -> ThreadPoolExecutor:
    """The process's media pool (made at first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MEDIA_THREADS, thread_name_prefix=THREAD_PREFIX)
        return _pool


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

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in the media pool, after this job's earlier items; MediaCancelled once the client
        is gone (the item is not started if it is still queued then)."""
        if self._turn is None:
            self._turn = asyncio.Lock()
        async with self._turn:
            await self._check()
            fut = asyncio.get_running_loop().run_in_executor(media_threads(), self._call, fn, args)
            try:
                while True:
                    done, _ = await asyncio.wait({fut}, timeout=POLL_S)
                    if done:
                        return fut.result()
                    await self._check()
            except BaseException:
                self.cancelled.set()
                fut.cancel()  # still queued: never runs; running: its result is dropped
                raise

    def _call(self, fn: Callable[..., Any], args: tuple) -> Any:
        if self.cancelled.is_set():  # the client left while this item was queued
            raise MediaCancelled()
        return fn(*args)

    async def _check(self) -> None:
        if not self.cancelled.is_set() and self.request is not None and await self.request.is_disconnected():
            self.cancelled.set()
        if self.cancelled.is_set():
            raise MediaCancelled()
