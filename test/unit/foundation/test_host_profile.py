"""SGLANG_CPROFILE_DIR (`utils/host_profile.py`): nothing without it; with it, a profile naming the profiled
functions, written also when the process is stopped with SIGTERM as the launcher stops the scheduler.
The scheduler's own hook is checked where the engine runs the real scheduler (`test_engine.py`)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

from sglang.srt.environ import envs
from sglang.srt.utils.host_profile import host_profile, top_rows
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")


def busy_for_the_profile() -> int:
    return sum(i * i for i in range(20000))


def test_without_the_variable_no_handler_is_installed():
    before = signal.getsignal(signal.SIGTERM)
    with envs.SGLANG_CPROFILE_DIR.override(None), host_profile("unit"):
        assert signal.getsignal(signal.SIGTERM) is before


def test_the_profile_names_the_profiled_function_and_the_handler_is_restored(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with envs.SGLANG_CPROFILE_DIR.override(str(tmp_path / "prof")), host_profile("unit"):
        assert signal.getsignal(signal.SIGTERM) is not before  # SIGTERM ends the body, profile written
        busy_for_the_profile()
    assert signal.getsignal(signal.SIGTERM) is before
    (path,) = (tmp_path / "prof").iterdir()
    assert path.name.startswith("unit-") and path.suffix == ".prof"
    assert any("busy_for_the_profile" in row for row in top_rows(path, n=50))


def test_off_the_main_thread_it_profiles_without_a_handler(tmp_path):
    before, errors = signal.getsignal(signal.SIGTERM), []

    def body():
        try:
            with envs.SGLANG_CPROFILE_DIR.override(str(tmp_path)), host_profile("thread"):
                busy_for_the_profile()
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    worker = threading.Thread(target=body)
    worker.start()
    worker.join()
    assert errors == [] and signal.getsignal(signal.SIGTERM) is before
    assert len(list(tmp_path.glob("thread-*.prof"))) == 1


SERVE = """
import sys, time
from pathlib import Path
from sglang.srt.utils.host_profile import host_profile

def serving_until_stopped():
    Path(sys.argv[1]).write_text("ready")
    while True:
        time.sleep(0.01)

with host_profile("child"):
    serving_until_stopped()
"""


def test_sigterm_still_writes_the_profile(tmp_path):
    ready = tmp_path / "ready"
    with envs.SGLANG_CPROFILE_DIR.override(str(tmp_path / "prof")):
        proc = subprocess.Popen([sys.executable, "-c", SERVE, str(ready)])
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the child did not start"
            time.sleep(0.05)
        proc.terminate()
        assert proc.wait(timeout=30) == 0  # SystemExit(0) from the handler, not death by the signal
    finally:
        proc.kill()
    (path,) = (tmp_path / "prof").iterdir()
    assert path.name == f"child-{proc.pid}.prof"
    assert any("serving_until_stopped" in row for row in top_rows(path, n=50))
