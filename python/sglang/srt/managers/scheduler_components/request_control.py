"""Scheduler-side request control that is not scheduling: deadlines and pausing.

`RequestDeadlines` aborts requests past upstream's limits (`SGLANG_REQ_WAITING_TIMEOUT`: still waiting
for their first admission; `SGLANG_REQ_RUNNING_TIMEOUT`: still running that long after they were
first seen running) with HTTP 503 and upstream's messages. `GenerationPause` implements the
scheduler's half of /pause_generation: while paused the event loop takes messages but runs no batch.
Both act between steps of the event loop, where client aborts act too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container
from typing import TYPE_CHECKING

from sglang.srt.environ import envs

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

    # (waiting queue, running requests, rids of every live request), read at each check.
    RequestViews = Callable[[], tuple[list[Req], list[Req], Container[str]]]
    # Finish the requests as aborted by the server with this message and HTTP status.
    AbortWithStatus = Callable[[list[Req], str, int], None]

logger = logging.getLogger(__name__)

SERVICE_UNAVAILABLE = 503
WAITING_TIMEOUT_MESSAGE = "Request waiting timeout reached."
RUNNING_TIMEOUT_MESSAGE = "Request running timeout reached."
# Deadlines are coarse (seconds); checking a few times a second keeps the queue scans off the hot path.
CHECK_INTERVAL_S = 0.05
PAUSE_MODES = ("retract", "in_place")


class RequestDeadlines:
    def __init__(
        self, requests: RequestViews, abort: AbortWithStatus, clock: Callable[[], float] = time.monotonic
    ):
        self.requests = requests
        self.abort = abort
        self.clock = clock
        self.waiting_timeout = envs.SGLANG_REQ_WAITING_TIMEOUT.get()
        self.running_timeout = envs.SGLANG_REQ_RUNNING_TIMEOUT.get()
        self.enabled = self.waiting_timeout > 0 or self.running_timeout > 0
        self._arrived: dict[str, float] = {}  # rid -> when the scheduler received it
        self._started: dict[str, float] = {}  # rid -> when it was first seen running (kept if retracted)
        self._next_check = 0.0

    def on_arrival(self, rid: str) -> None:
        if self.enabled:
            self._arrived[rid] = self.clock()

    def check(self) -> None:
        if not self.enabled:
            return
        now = self.clock()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        waiting, running, live = self.requests()
        self._arrived = {rid: t for rid, t in self._arrived.items() if rid in live}
        self._started = {rid: t for rid, t in self._started.items() if rid in live}
        for req in running:
            self._started.setdefault(req.rid, now)
        if self.waiting_timeout > 0:
            late = [
                r
                for r in waiting
                if r.rid not in self._started and now - self._arrived.get(r.rid, now) > self.waiting_timeout
            ]
            if late:
                logger.info("Aborting %d request(s) past SGLANG_REQ_WAITING_TIMEOUT.", len(late))
                self.abort(late, WAITING_TIMEOUT_MESSAGE, SERVICE_UNAVAILABLE)
        if self.running_timeout > 0:
            late = [
                r for r in running if not r.finished and now - self._started[r.rid] > self.running_timeout
            ]
            if late:
                logger.info("Aborting %d request(s) past SGLANG_REQ_RUNNING_TIMEOUT.", len(late))
                self.abort(late, RUNNING_TIMEOUT_MESSAGE, SERVICE_UNAVAILABLE)


class GenerationPause:
    """While paused, no batch runs. "in_place" leaves every request as it is (a batch in flight stays
    in flight); "retract" first has the scheduler finish the batches in flight and send every running
    request back to the waiting queue (`retract_all`), so that their KV and state slots are free (and
    the cache can be flushed)."""

    def __init__(self, retract_all: Callable[[], None]):
        self.retract_all = retract_all
        self.paused = False

    def pause(self, mode: str) -> None:
        assert mode in PAUSE_MODES, mode
        self.paused = True
        if mode == "retract":
            self.retract_all()
        logger.info("Generation paused (%s).", mode)

    def resume(self) -> None:
        self.paused = False
        logger.info("Generation continued.")
