"""Process faults of a real server: its children never outlive it, and a backend that dies or stalls
ends the server with status 1 after in-flight requests got HTTP 503 (no hanging, no lingering).

- SIGKILL of the server process: the scheduler, the detokenizer (which had output in flight) and the
  tokenizer worker (started by a long prompt) are gone within a few seconds.
- A SIGSTOPped scheduler with --watchdog-timeout 3: /health turns 503 after the timeout (never before),
  the waiting request and a waiting /flush_cache get 503, the server exits with status 1 and leaves no process behind.
- A forward slower than --watchdog-timeout: the scheduler reports it with its batch and exits, the
  waiting request gets 503 and the server exits with status 1.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest
import requests

from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerProcess

register_cpu_ci(est_time=38, suite="per-commit-cpu")

MODEL = ["--model-path", "tiny-qwen3-next"]
EXIT_TIMEOUT_S = 20.0


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def running(pid: int) -> bool:
    """The process exists and is not a zombie (a dead child its new parent has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if running(p)]
        if not left:
            return []
        time.sleep(0.1)
    return [p for p in pids if running(p)]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass


def started_pid(server: ServerProcess, name: str) -> int:
    m = re.search(rf"the {name} \(pid (\d+)\)", server.log_text())
    assert m, server.log_text()[-3000:]
    return int(m.group(1))


def post_in_thread(url: str, body: dict, out: dict) -> threading.Thread:
    def run() -> None:
        try:
            r = requests.post(url, json=body, timeout=60)
            out["status"], out["body"] = r.status_code, r.json()
        except Exception as e:  # noqa: BLE001 - the test reports it
            out["error"] = repr(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


# Each test's server: (flags, environment).
SERVERS = {
    # A slow forward keeps output flowing through the detokenizer when the server dies.
    "killed": (MODEL, {"SGLANG_TEST_FORWARD_DELAY_MS": "20"}),
    "stopped": ([*MODEL, "--watchdog-timeout", "3"], None),
    # No warm-up: its forward would be the one past the watchdog (test_server_warmup covers that).
    "slow": (
        [*MODEL, "--watchdog-timeout", "2", "--disable-overlap-schedule", "--skip-server-warmup"],
        {"SGLANG_TEST_FORWARD_DELAY_MS": "4000"},
    ),
}


@pytest.fixture(scope="module")
def launched():
    """The three tests' servers, started together when the first test starts: the later ones load while
    the earlier tests run instead of one after another. Each test takes its own (`servers` stops it)."""
    procs = {name: ServerProcess(args, env=env) for name, (args, env) in SERVERS.items()}
    try:
        yield procs
    finally:
        for server in procs.values():
            server.stop()  # (again, for one a test stopped)


@pytest.fixture
def servers():
    """Started servers, and every child they had, are gone after the test whatever happened."""
    started: list[ServerProcess] = []
    kids: list[int] = []
    yield started, kids
    kill_all(kids)
    for server in started:
        server.stop()


def test_sigkill_of_the_server_takes_every_child_with_it(servers, launched):
    started, kids = servers
    server = launched["killed"]
    started.append(server)
    server.wait_ready()
    # A prompt this long is tokenized in the tokenizer worker process (refused: beyond the context).
    r = requests.post(server.base_url + "/generate", json={"text": "hello " * 20000}, timeout=60)
    assert r.status_code == 400, r.text
    stream = requests.post(
        server.base_url + "/generate",
        json={
            "input_ids": [5, 6, 7],
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
            "stream": True,
        },
        stream=True,
        timeout=60,
    )
    lines = stream.iter_lines()
    assert next(line for line in lines if line).startswith(b"data:")
    kids += children(server.proc.pid)
    assert len(kids) >= 3, f"scheduler, detokenizer and tokenizer worker expected: {kids}"

    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(10)
    left = wait_gone(kids, 5.0)
    assert not left, f"children still running 5 s after the server was killed: {left}"
    stream.close()


def test_a_stopped_scheduler_makes_the_server_unhealthy_then_exit(servers, launched):
    started, kids = servers
    server = launched["stopped"]
    started.append(server)
    server.wait_ready()
    kids += children(server.proc.pid)
    scheduler = started_pid(server, "scheduler")
    assert scheduler in kids

    os.kill(scheduler, signal.SIGSTOP)
    stopped_at = time.monotonic()
    reply: dict = {}
    waiter = post_in_thread(
        server.base_url + "/generate",
        {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 8}},
        reply,
    )
    # A control call waiting on the scheduler fails with it too: 503, not a 500 (or its 30 s timeout).
    flushed: dict = {}
    flusher = post_in_thread(server.base_url + "/flush_cache", {}, flushed)
    health = []  # (seconds since SIGSTOP, status or None when refused)
    while server.proc.poll() is None and time.monotonic() - stopped_at < EXIT_TIMEOUT_S:
        try:
            status = requests.get(server.base_url + "/health", timeout=1).status_code
        except requests.RequestException:
            status = None
        health.append((time.monotonic() - stopped_at, status))
        time.sleep(0.1)
    assert server.proc.wait(EXIT_TIMEOUT_S) == 1, server.log_text()[-3000:]

    first_bad = next(i for i, (_, s) in enumerate(health) if s != 200)
    assert 3.0 <= health[first_bad][0] <= 6.0, health
    assert health[first_bad][1] == 503, f"/health answered 503 before the server went away: {health}"
    assert all(s != 200 for _, s in health[first_bad:]), health
    waiter.join(10)
    assert reply.get("status") == 503, reply
    flusher.join(10)
    assert flushed.get("status") == 503 and flushed["body"]["error"]["code"] == "backend_dead", flushed
    assert "The scheduler has not answered for" in reply["body"]["error"]["message"], reply
    log = server.log_text()
    assert re.search(
        r"Watchdog: The scheduler has not answered for \d+\.\d s \(--watchdog-timeout 3 s\)", log
    )
    assert "The server shuts down." in log
    left = wait_gone(kids, 5.0)
    assert not left, f"children still running after the server exited: {left}"


def test_a_scheduler_watchdog_exit_fails_the_request_and_ends_the_server(servers, launched):
    started, kids = servers
    server = launched["slow"]
    started.append(server)
    server.wait_ready()
    kids += children(server.proc.pid)

    r = requests.post(
        server.base_url + "/generate",
        json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}},
        timeout=EXIT_TIMEOUT_S,
    )
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "backend_dead", r.text
    assert server.proc.wait(EXIT_TIMEOUT_S) == 1, server.log_text()[-3000:]
    log = server.log_text()
    assert re.search(r"Watchdog: The forward of batch \d+ \(extend, 1 requests, 3 tokens", log), log[-3000:]
    assert "The scheduler process has exited (exit code 1). The server shuts down." in log, log[-3000:]
    left = wait_gone(kids, 5.0)
    assert not left, f"children still running after the server exited: {left}"
