"""`SGLANG_CPROFILE_DIR`: a cProfile of a process's host work, for finding where the wall time beyond the
device's goes (the GPU path is host-bound at small models).

Set to a folder, the scheduler process runs its event loop under cProfile and writes
`<folder>/scheduler-<pid>.prof` when it stops, SIGTERM included (the launcher's shutdown): while profiling,
SIGTERM raises SystemExit in the main thread so the profile is written. Read one with `pstats`
(`python -m pstats FILE`, or `top_rows` here). On Python 3.12+ cProfile sees every thread of the process
(it hooks `sys.monitoring`), so the forward stream's thread is in the same profile; on 3.11 only the
scheduler thread is. Profiling slows the Python it sees (~1.5-2x): use it to rank, not to time.
"""

from __future__ import annotations

import cProfile
import logging
import os
import pstats
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sglang.srt.environ import envs

logger = logging.getLogger(__name__)


def _exit_on_term(signum: int, frame: object) -> None:
    sys.exit(0)


@contextmanager
def host_profile(process: str) -> Iterator[None]:
    """Run the body under cProfile when SGLANG_CPROFILE_DIR is set (main thread only); else nothing."""
    folder = envs.SGLANG_CPROFILE_DIR.get()
    if not folder:
        yield
        return
    path = Path(folder) / f"{process}-{os.getpid()}.prof"
    path.parent.mkdir(parents=True, exist_ok=True)
    previous = signal.signal(signal.SIGTERM, _exit_on_term)
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        signal.signal(signal.SIGTERM, previous)
        prof.dump_stats(path)
        logger.info("Host profile written to %s.", path)


def top_rows(path: str | Path, n: int = 25) -> list[str]:
    """The `n` functions with the most own time in a profile file: "own s, cumulative s, calls, where"."""
    stats = pstats.Stats(str(path))
    rows = [
        (own, cum, calls, f"{Path(file).name}:{line}({name})")
        for (file, line, name), (_, calls, own, cum, _) in stats.stats.items()
    ]
    rows.sort(reverse=True)
    return [f"{own:8.3f} s own {cum:8.3f} s cum {calls:8d}x {where}" for own, cum, calls, where in rows[:n]]
