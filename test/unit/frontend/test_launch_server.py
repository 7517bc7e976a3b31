"""`python -m sglang.launch_server` refuses bad flags, a transfer backend it lacks, a tokenizer that is
not there, pools too small to serve and a port in use with one sentence and a non-zero exit, without a
traceback (and without claiming to be ready)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=40, suite="per-commit-cpu")


def launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", *args], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "args, code, words",
    [
        (["--page-size", "0"], 2, "--page-size must be a positive integer"),
        (["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "nixl"], 1,
         "--disaggregation-transfer-backend nixl: this server moves KV and state with mooncake only"),
        (["--tokenizer-path", "/nonexistent/tok"], 2, "--tokenizer-path '/nonexistent/tok' is not a folder"),
        (["--max-mamba-cache-size", "1"], 1, "--max-mamba-cache-size 1 is smaller than the 2 slot(s)"),
    ],
)
def test_refusals_are_one_sentence(args, code, words):
    proc = launch(*args)
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
