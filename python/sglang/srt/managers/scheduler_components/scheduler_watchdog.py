"""The scheduler process's last resorts: a forward that runs past --watchdog-timeout, and a TP rank that is
gone. Neither leaves anything to shut down cleanly, so the process logs one sentence and exits non-zero at
once; the server sees its scheduler gone and stops. (Kept out of `scheduler.py`, whose process entry uses
them.)"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

logger = logging.getLogger("sglang.srt.managers.scheduler")  # the scheduler's log, as its other parts


class SchedulerWatchdogError(RuntimeError):
    """A forward did not finish within --watchdog-timeout: the forward stream is stuck."""


def exit_now(message: str, prefix: str = "Watchdog: ") -> None:
    logger.error("%s%s The scheduler exits.", prefix, message)
    logging.shutdown()
    os._exit(1)


def watch_inline_forward(sched: Any) -> None:
    """The watchdog of a forward stream on the scheduler thread (the CPU default): a forward running
    past --watchdog-timeout ends the process with the batch named, as the wait on a forward thread
    does. Checks four times per timeout (at most once a second)."""
    timeout = sched.watchdog_timeout
    while True:
        time.sleep(min(timeout / 4, 1.0))
        running = sched.running_inline
        if running is not None and time.monotonic() - running[1] > timeout:
            exit_now(stuck_forward_message(running[0], timeout))


def stuck_forward_message(batch: Any, timeout: float) -> str:
    """The sentence that names a forward (a `ScheduleBatch`) running past --watchdog-timeout."""
    return (
        f"The forward of batch {batch.batch_id} ({batch.forward_mode.name.lower()}, "
        f"{batch.batch_size} requests, {batch.forward_batch.num_tokens} tokens, rids "
        f"{[r.rid for r in batch.reqs[:8]]}) did not finish within --watchdog-timeout {timeout:g} s."
    )


def wait_forward(batch: Any, fut: Any, timeout: float | None) -> Any:
    """The host result of `batch`'s forward (`fut`, the forward worker's), once it has run: a
    SchedulerWatchdogError naming the batch where that took past --watchdog-timeout `timeout` (None: no
    limit). A forward run on the scheduler thread (`RanFuture`) is judged by how long it ran."""
    from concurrent.futures import TimeoutError as FutureTimeoutError

    from sglang.srt.model_executor.forward_worker import RanFuture

    try:
        result = fut.result(timeout=timeout).wait(timeout)
        if isinstance(fut, RanFuture) and timeout is not None and fut.seconds > timeout:
            # (in a scheduler process `watch_inline_forward` ends one that runs too long; elsewhere, an
            # in-process scheduler, it is reported once it returns)
            raise TimeoutError
    except (FutureTimeoutError, TimeoutError):
        raise SchedulerWatchdogError(stuck_forward_message(batch, timeout)) from None
    return result
