"""Registration of test files into CI suites.

Each test file calls `register_cpu_ci(est_time=..., suite=...)` at module level. The call does nothing
at run time: `test/run_suite.py` finds it by reading the file's syntax tree, so a suite is selected
without importing any test module.
"""

from __future__ import annotations

SUITES = ("per-commit-cpu", "nightly-cpu")


def register_cpu_ci(est_time: float, suite: str = "per-commit-cpu") -> None:
    if suite not in SUITES:
        raise ValueError(f"Unknown CI suite {suite!r}; known suites: {', '.join(SUITES)}.")
    if est_time <= 0:
        raise ValueError("est_time must be positive (seconds).")
