"""run_gpu_checks.sh, the script a session lent a GPU runs: a test group stopped at its time limit still
says which tests ran and why it stopped (under `timeout`'s default SIGTERM pytest died printing nothing
but its progress dots, so a group cut short came back without a single test name). Nightly: ~25 s, the
shortest limit the script gives a group is 20 s."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="nightly-cpu")

SCRIPT = Path(__file__).resolve().parents[3] / "benchmark" / "gpu" / "run_gpu_checks.sh"

GROUP = '''
import time

import pytest


@pytest.mark.gpu
def test_quick():
    assert True


@pytest.mark.gpu
def test_fails():
    assert 1 + 1 == 3, "the reason"


@pytest.mark.gpu
def test_stuck():
    time.sleep(600)
'''


def test_a_group_cut_at_its_limit_names_its_tests_and_reports(tmp_path):
    tests = tmp_path / "tests" / "test_group.py"
    tests.parent.mkdir()
    tests.write_text(GROUP)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    env = {
        **os.environ,
        "OUT": str(out),
        "PYTEST_ARGS": str(tests),  # the `custom` group: these targets instead of the GPU tests
        "TEST_LIMIT": "20",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",  # its python3
    }
    started = time.monotonic()
    subprocess.run(["bash", str(SCRIPT), "tests"], cwd=work, env=env, capture_output=True, timeout=150)
    took = time.monotonic() - started
    # Every log comes back in one tarball (the device tool returns at most 8 files), none beside it.
    assert sorted(p.name for p in out.iterdir()) == ["fla-autotune.tar.gz", "logs.tar.gz", "summary.txt"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        log = tar.extractfile("tests-custom.log").read().decode()
    assert "test_group.py::test_quick PASSED" in log, log[-2000:]  # -v: each test named as it ends
    assert "KeyboardInterrupt" in log and "test_stuck" in log, log[-2000:]  # stopped as at ^C: reported
    summary = (out / "summary.txt").read_text()
    assert "tests custom: exit 124" in summary, summary  # timeout's status for a command it stopped
    # The failures' lines in the summary itself, should the tarball not come back.
    assert "FAILED" in summary and "test_fails" in summary and "the reason" in summary, summary
    assert took < 20 + 20 + 30, took  # the limit, timeout's -k grace, the script's own start
