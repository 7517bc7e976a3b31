"""The code base stays ruff-clean (lint rules in pyproject.toml)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")

ROOT = Path(__file__).resolve().parents[2]


def test_ruff_check_passes():
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "python", "test", "benchmark"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
