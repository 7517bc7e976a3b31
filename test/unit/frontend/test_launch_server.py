"""`python -m sglang.launch_server` refuses bad flags and the disaggregation modes with one sentence
and a non-zero exit, before starting anything and without a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--page-size", "0"], 2, "--page-size must be a positive integer"),
        (["--disaggregation-mode", "prefill"], 1, "--disaggregation-mode prefill: disaggregated"),
        (["--disaggregation-mode", "decode"], 1, "--disaggregation-mode decode: disaggregated"),
    ],
)
def test_refusals_are_one_sentence(args, code, words):
    proc = launch(*args)
    assert proc.returncode == code, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and words in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr
