"""`python -m sglang.launch_server` refuses bad flags, a tokenizer that is not there or cannot be loaded,
pools too small to serve and a port in use with one sentence and a non-zero exit, without a traceback
(and without claiming to be ready). A transfer backend it lacks: test_flag_audit."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=35, suite="per-commit-cpu")


def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


REFUSALS = [
    (["--page-size", "0"], 2, "--page-size must be a positive integer"),
    # upstream's value, no longer argparse's "invalid choice" (issue 60)
    (["--kv-cache-dtype", "mxfp8"], 2, "--kv-cache-dtype mxfp8 is not supported by this server"),
    (["--tokenizer-path", "/nonexistent/tok"], 2, "--tokenizer-path '/nonexistent/tok' is not a folder"),
    # (extra_buffer: a running slot and its two track slots; extra_buffer_lazy runs in one since issue 61)
    (["--mamba-scheduler-strategy", "extra_buffer", "--max-mamba-cache-size", "2"], 1,
     "--max-mamba-cache-size 2 is smaller than the 3 slot(s)"),
]  # fmt: skip


@pytest.fixture(scope="module")
def refusal_launches():
    """Every refusal's launch, started at once when the first case runs: each is its own process (mostly
    imports, and the last one loads the model), so they overlap on two cores instead of queueing."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "sglang.launch_server", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for args, _, _ in REFUSALS
    ]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()  # (a no-op once it exited)
            proc.communicate()


@pytest.mark.parametrize("case", range(len(REFUSALS)), ids=lambda k: " ".join(REFUSALS[k][0]))
def test_refusals_are_one_sentence(case, refusal_launches):
    args, code, words = REFUSALS[case]
    stdout, stderr = refusal_launches[case].communicate(timeout=120)
    proc = subprocess.CompletedProcess(args, refusal_launches[case].returncode, stdout, stderr)
    assert proc.returncode == code, proc.stderr
    assert_one_error(proc, words)


def assert_one_error(proc: subprocess.CompletedProcess, words: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and words in errors[0], proc.stderr
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    assert errors[0].count(". ") == 0 and errors[0].endswith("."), "one sentence"


def test_a_port_in_use_fails_before_anything_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        proc = launch("--host", "127.0.0.1", "--port", str(port))
    assert proc.returncode == 1, proc.stderr
    assert_one_error(proc, f"--port {port} is already in use on 127.0.0.1")
    assert "ready to roll" not in proc.stderr + proc.stdout


def test_an_unloadable_tokenizer_stops_the_started_subprocesses(preset_paths, tmp_path):
    """The scheduler and detokenizer start before the tokenizer loads (they import torch and load the
    model meanwhile): a tokenizer that cannot be loaded is one sentence, and no process of the launch is
    left (each carries a marker in its environment, looked for in /proc), nor their IPC files (made in
    the launch's TMPDIR)."""
    model, tmp = tmp_path / "model", tmp_path / "tmp"
    shutil.copytree(preset_paths["tiny-qwen3-next"], model)
    (model / "tokenizer.json").write_text("not json")
    tmp.mkdir()
    marker = f"sglang-launch-test-{uuid.uuid4().hex}"
    env = {**os.environ, "SGLANG_TEST_LAUNCH_MARKER": marker, "TMPDIR": str(tmp)}
    proc = launch("--model-path", str(model), env=env)
    assert proc.returncode == 1, proc.stderr
    assert_one_error(proc, f"--tokenizer-path {str(model)!r}: the tokenizer cannot be loaded")
    assert sorted(p.name for p in tmp.glob("sglang-*")) == []
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []


def test_a_refused_flag_leaves_no_process_of_the_launch():
    """The launcher spawns its children before it checks the flags (`prestart.py`): a refused flag
    stops them as it exits (status 2, one sentence), none is left."""
    marker = f"sglang-launch-test-{uuid.uuid4().hex}"
    popen = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--page-size", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "SGLANG_TEST_LAUNCH_MARKER": marker},
    )  # fmt: skip
    most = 0  # (the launcher and its warm children, seen while it imports and checks the flags)
    deadline = time.monotonic() + 120
    while popen.poll() is None and time.monotonic() < deadline:
        most = max(most, len(_processes_with(marker)))
        time.sleep(0.05)
    if popen.poll() is None:
        popen.kill()  # (a launcher that hangs at exit: joining children no one stopped)
    stdout, stderr = popen.communicate(timeout=30)
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
    assert proc.returncode == 2, proc.stderr
    assert_one_error(proc, "--page-size must be a positive integer")
    assert most >= 3, most  # the launcher, a scheduler's and the detokenizer's warm children
    deadline = time.monotonic() + 10
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _processes_with(marker) == []


def _processes_with(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            pass
    return found


def test_the_port_refuses_connections_until_the_server_serves():
    """Bound early (so a port in use fails first), but not listening: a client that connects while the
    model loads is refused at once rather than left hanging in the backlog."""
    from sglang.launch_server import bind_socket

    sock = bind_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    finally:
        sock.close()
