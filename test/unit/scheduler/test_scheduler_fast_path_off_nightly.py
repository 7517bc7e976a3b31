"""Nightly: every scheduler test file with the decode fast path off (SGLANG_TEST_DISABLE_DECODE_FAST_PATH:
each decode step selects, builds and commits in full, nothing ever waits in the logs), in a subprocess so
that the switch holds for every scheduler the files build. The per-commit suite runs a few representative
cases that way (test_decode_fast_path_off.py); this is all of them. By hand:

    SGLANG_TEST_DISABLE_DECODE_FAST_PATH=1 .venv/bin/python -m pytest -q test/unit/scheduler \\
        --ignore=test/unit/scheduler/test_decode_fast_path_off.py \\
        --ignore=test/unit/scheduler/test_decode_token_log.py \\
        --ignore=test/unit/scheduler/test_decode_set_cache.py \\
        --ignore=test/unit/scheduler/test_decode_rows_cache.py \\
        --ignore=test/unit/scheduler/test_scheduler_fast_path_off_nightly.py

The fast path's own files are left out: they count what its parts cached or logged."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1200, suite="nightly-cpu")

HERE = Path(__file__).resolve().parent
FAST_PATH_OWN = [
    "test_decode_fast_path_off.py",
    "test_decode_token_log.py",
    "test_decode_set_cache.py",
    "test_decode_rows_cache.py",
    Path(__file__).name,
]


def test_every_scheduler_file_passes_with_the_fast_path_off():
    env = dict(os.environ, SGLANG_TEST_DISABLE_DECODE_FAST_PATH="1")
    ignores = [f"--ignore={HERE / name}" for name in FAST_PATH_OWN]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(HERE), *ignores]
    run = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=3600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
