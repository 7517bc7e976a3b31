"""Upstream's `--gc-warning-threshold-secs`: a warning for every garbage collection of this process that
took longer than the threshold (a full collection walks every object the process holds, and holds the
interpreter meanwhile: the event loop or the scheduler's loop stalls), with what freezes it."""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

logger = logging.getLogger(__name__)

_watching: list[Any] = []  # this process's callback, once


def watch_gc(threshold_s: float) -> None:
    """Log each collection of this process longer than `threshold_s` seconds (0: nothing is watched)."""
    if threshold_s <= 0 or _watching:
        return
    started = [0.0]

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
            return
        took = time.perf_counter() - started[0]
        if took > threshold_s:
            logger.warning(
                "A garbage collection (generation %d) took %.3f s, over --gc-warning-threshold-secs %g: %d "
                "objects collected, %d uncollectable. It stalls this process; /freeze_gc after a warm-up "
                "takes what is held then out of its reach.",
                info.get("generation", -1), took, threshold_s, info.get("collected", 0), info.get("uncollectable", 0),
            )  # fmt: skip

    gc.callbacks.append(callback)
    _watching.append(callback)


def unwatch_gc() -> None:
    """Stop watching (tests: the callback would outlive them in their process)."""
    while _watching:
        gc.callbacks.remove(_watching.pop())
