"""A file written under a temporary name of its own in its folder, then renamed into place: a reader
never sees it half written, and a symlink at its name is replaced, never written through (the profiler's
traces, the expert distribution's dumps)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import Any


def _umask() -> int:
    """The process's umask (Linux reads it without changing it; elsewhere it is set back at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_file(folder: str, name: str, write: Callable[[str], Any]) -> str:
    """`write(path)` to a new file in `folder`, given the mode a plain open would give it (mkstemp's is
    0600), then renamed to `name` there; the path. A failure leaves no file behind."""
    fd, tmp = tempfile.mkstemp(prefix=".partial-", suffix=name, dir=folder)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, os.path.join(folder, name))
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return os.path.join(folder, name)
