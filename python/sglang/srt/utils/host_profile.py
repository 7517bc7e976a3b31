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
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from sglang.srt.environ import envs

logger = logging.getLogger(__name__)


def _exit_on_term(signum: int, frame: object) -> None:
    sys.exit(0)


@contextmanager
def host_profile(process: str) -> Iterator[None]:
    """Run the body under cProfile when SGLANG_CPROFILE_DIR is set; else nothing. In the main thread
    SIGTERM then ends the body with SystemExit (signal handlers can only be set there)."""
    folder = envs.SGLANG_CPROFILE_DIR.get()
    if not folder:
        yield
        return
    path = Path(folder) / f"{process}-{os.getpid()}.prof"
    path.parent.mkdir(parents=True, exist_ok=True)
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _exit_on_term) if main else None
    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        if main:  # (None: a handler set outside Python, which Python cannot reinstall)
            signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        prof.dump_stats(path)
        logger.info("Host profile written to %s.", path)


_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6}


def top_rows(source: str | Path | cProfile.Profile, n: int = 25, per: int = 1, unit: str = "s") -> list[str]:
    """The `n` functions with the most own time in a profile (a file, or a `cProfile.Profile`), as
    "own, cumulative, calls, where"; times in `unit` and calls divided by `per` (e.g. per step)."""
    stats = pstats.Stats(source if isinstance(source, cProfile.Profile) else str(source))
    scale = _UNITS[unit] / per
    rows = [
        (own * scale, cum * scale, calls / per, f"{Path(file).name}:{line}({name})")
        for (file, line, name), (_, calls, own, cum, _) in stats.stats.items()
    ]
    rows.sort(reverse=True)
    return [
        f"{own:9.3f} {unit} own {cum:9.3f} {unit} cum {calls:8.1f}x {where}"
        for own, cum, calls, where in rows[:n]
    ]
