"""`CompilePool`: the threads grammars compile on (xgrammar's compiler releases the GIL), `threads` at a
time in submission order.

xgrammar cannot stop a compile midway, and a process of its own per compile would cost more than the
compile (a compiled grammar crosses processes only as JSON, whose serialization takes many times the
compile and megabytes; timings: benchmark/README.md). So a compile the scheduler gives up on (`abandon`, past
SGLANG_GRAMMAR_TIMEOUT) stops counting against the pool: the next grammar starts at once on a thread
of its own, while the abandoned compile runs to its end for nobody. At most `max_abandoned` run so at
a time (each holds a CPU core); beyond that a timed-out compile keeps its place until it ends. The
bounds checked before a grammar gets here (`grammar_spec.py`) keep such a compile short.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class CompilePool:
    def __init__(self, threads: int, max_abandoned: int = 4, name: str = "grammar-compile"):
        self.threads = threads
        self.max_abandoned = max_abandoned
        self.name = name
        self._lock = threading.Lock()
        self._pending: deque[tuple[Future, Callable[..., Any], tuple]] = deque()
        self._running: set[Future] = set()  # the compiles that count against `threads`
        self._abandoned: set[Future] = set()  # given up on, still running
        self._closed = False

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            self._pending.append((fut, fn, args))
            self._start()
        return fut

    def abandon(self, fut: Future) -> bool:
        """Stop counting `fut`'s running compile against the pool; False if it is not running or
        `max_abandoned` already are."""
        with self._lock:
            if fut not in self._running or len(self._abandoned) >= self.max_abandoned:
                return False
            self._running.discard(fut)
            self._abandoned.add(fut)
            self._start()
            return True

    @property
    def counts(self) -> tuple[int, int, int]:
        """(queued, running, abandoned and still running) compiles."""
        with self._lock:
            return len(self._pending), len(self._running), len(self._abandoned)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            for fut, _, _ in self._pending:
                fut.cancel()
            self._pending.clear()

    def _start(self) -> None:
        """Start queued compiles while fewer than `threads` count (the lock held)."""
        while self._pending and len(self._running) < self.threads and not self._closed:
            fut, fn, args = self._pending.popleft()
            if not fut.set_running_or_notify_cancel():
                continue  # (cancelled while queued)
            self._running.add(fut)
            threading.Thread(target=self._run, args=(fut, fn, args), name=self.name, daemon=True).start()

    def _run(self, fut: Future, fn: Callable[..., Any], args: tuple) -> None:
        try:
            result = fn(*args)
        except BaseException as e:  # noqa: BLE001 - the request's compile error, read from its future
            fut.set_exception(e)
        else:
            fut.set_result(result)
        finally:
            with self._lock:
                self._running.discard(fut)
                self._abandoned.discard(fut)
                self._start()
