"""Whether the scheduler and detokenizer can still serve, as the TokenizerManager sees it.

Two faults make requests unservable: a child process that has exited (the launcher's `failure()`), and
a scheduler that has sent nothing for longer than --watchdog-timeout plus a grace. The scheduler's loop
sends a `SchedulerHeartbeat` every `HEARTBEAT_INTERVAL_S` while it runs, so silence means it is stopped
(SIGSTOP) or wedged outside a forward; a forward that hangs is reported earlier, with its batch, by the
scheduler's own watchdog, which then exits. A stall is declared once and for good: the HTTP server exits
on it, and an Engine fails its requests from then on. A watchdog timeout of 0 or less turns the silence
check off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from sglang.srt.managers.io_struct import SCHEDULER_STALL_GRACE_S

logger = logging.getLogger(__name__)


class BackendDeadError(RuntimeError):
    """A process the server needs (scheduler, detokenizer, tokenizer worker) is gone or stalled: the
    requests that wait for it can never finish (HTTP 503)."""


# How often the scheduler's silence is checked.
CHECK_INTERVAL_S = 0.25
# A check that comes this much later than planned means this event loop was held up: messages may wait
# unread, so the silence is judged at the next check.
LOOP_LAG_S = 1.0


class BackendHealth:
    def __init__(self, watchdog_timeout: float | None, process_failure: Callable[[], str | None]):
        self.watchdog_timeout = watchdog_timeout  # None: the silence check is off
        self.process_failure = process_failure
        self.last_heard = time.monotonic()
        self.stall: str | None = None
        self.declared: str | None = None  # a failure found elsewhere (the server's warm-up request)

    def heard(self) -> None:
        """A message from the scheduler arrived."""
        self.last_heard = time.monotonic()

    def error(self) -> str | None:
        """Why requests cannot be served, in one sentence, or None."""
        return self.process_failure() or self.stall or self.declared

    def declare(self, reason: str) -> None:
        """Requests cannot be served, for a reason found outside this class (once and for good)."""
        self.declared = self.declared or reason

    async def watch(self) -> None:
        """Run on the receiving loop until a stall is declared (a no-op with the watchdog off)."""
        timeout = self.watchdog_timeout
        if timeout is None:
            return
        self.last_heard = last_check = time.monotonic()
        while self.stall is None:
            await asyncio.sleep(CHECK_INTERVAL_S)
            now = time.monotonic()
            lagged = now - last_check > CHECK_INTERVAL_S + LOOP_LAG_S
            last_check = now
            silent = now - self.last_heard
            if lagged or silent <= timeout + SCHEDULER_STALL_GRACE_S or self.process_failure():
                continue
            self.stall = (
                f"The scheduler has not answered for {silent:.1f} s (--watchdog-timeout {timeout:g} s)."
            )
            logger.error("Watchdog: %s", self.stall)
