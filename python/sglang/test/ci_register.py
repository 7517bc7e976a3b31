"""Registration of test files into CI suites.

Each test file calls `register_cpu_ci(est_time=..., suite=...)` at module level. The call does nothing
at run time: `test/run_suite.py` finds it by reading the file's syntax tree, so a suite is selected
without importing any test module.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TypeVar

SUITES = ("per-commit-cpu", "nightly-cpu")
# Set by the nightly-cpu file test/registered/test_full_matrix_nightly.py: the cases a per-commit file
# keeps out of CI (`per_commit_cases`) run too.
FULL_MATRIX_ENV = "SGLANG_TEST_FULL_MATRIX"
T = TypeVar("T")


def register_cpu_ci(est_time: float, suite: str = "per-commit-cpu") -> None:
    if suite not in SUITES:
        raise ValueError(f"Unknown CI suite {suite!r}; known suites: {', '.join(SUITES)}.")
    if est_time <= 0:
        raise ValueError("est_time must be positive (seconds).")


def full_matrix() -> bool:
    return os.environ.get(FULL_MATRIX_ENV) == "1"


def per_commit_cases(cases: Sequence[T], kept: Sequence[T]) -> list[T]:
    """`cases` in the nightly run (FULL_MATRIX_ENV), else the `kept` ones: a parametrized test whose
    other cases repeat what the kept ones cover per commit (another preset through the same path)."""
    return list(cases) if full_matrix() else [c for c in cases if c in kept]
