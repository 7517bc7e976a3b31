"""A child process of the server ends when its parent does, however the parent ends (SIGKILL included).

Two mechanisms, so that neither a stopped child nor a non-Linux host is left out:
- Linux: the kernel sends the child SIGKILL when its parent dies (`prctl(PR_SET_PDEATHSIG)`). It works
  even on a stopped (SIGSTOP) child. The kernel ties it to the *thread* that started the child, so it is
  only asked for when that thread lives as long as the process (the main thread) or as long as the
  child should (the loop thread that owns the tokenizer worker).
- Everywhere: a daemon thread waits on multiprocessing's parent sentinel (a pipe the parent holds open
  until it exits) and ends the process when it closes. It covers the rest, and the window between the
  spawn and the prctl call.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing as mp
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
# The status a child exits with when it finds its parent gone (nobody reads it: it is for `ps` and
# for tests).
ORPHAN_EXIT_CODE = 1


def exit_with_parent(name: str, use_pdeathsig: bool = True) -> None:
    """Arrange for this process (`name`, for the log) to exit once its multiprocessing parent is gone.
    A no-op in a process that multiprocessing did not start."""
    parent = mp.parent_process()
    if parent is None:
        return
    if use_pdeathsig and sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning(
                "prctl(PR_SET_PDEATHSIG) failed (errno %d); watching the parent only.", ctypes.get_errno()
            )
    if not parent.is_alive():  # it died before the prctl call took effect
        os._exit(ORPHAN_EXIT_CODE)

    def watch() -> None:
        parent.join()
        logger.info("The parent process is gone; the %s exits.", name)
        os._exit(ORPHAN_EXIT_CODE)

    threading.Thread(target=watch, name="sglang-parent-watch", daemon=True).start()
