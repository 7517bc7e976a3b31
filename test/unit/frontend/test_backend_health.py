"""Backend faults as the front end sees them, against the fake scheduler: a scheduler silent for longer
than --watchdog-timeout (plus the grace) is declared stalled once, fails waiting and new requests with
BackendDeadError and makes /health and /health_generate answer 503; the check is off with a timeout of 0
and is not fooled by its own event loop being held up. Children exit with their parent even where the
kernel's parent-death signal is not asked for, and an Engine started on a short-lived thread keeps them."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import sglang
from sglang.srt.entrypoints.http_server import create_app
from sglang.srt.environ import envs
from sglang.srt.managers.backend_health import BackendHealth
from sglang.srt.managers.io_struct import SCHEDULER_STALL_GRACE_S
from sglang.srt.managers.tokenizer_manager import BackendDeadError
from sglang.srt.server_args import ServerArgs
from sglang.test import fake_scheduler
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=18, suite="per-commit-cpu")


async def asgi_get(app, path: str) -> int:
    """The status of GET `path` on an ASGI app, without a socket."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }
    sent = []

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    return next(m["status"] for m in sent if m["type"] == "http.response.start")


# ---- BackendHealth ---------------------------------------------------------------------------------


def test_silence_past_the_timeout_and_grace_is_a_stall_declared_once(caplog):
    async def scenario() -> tuple[float, str | None]:
        health = BackendHealth(0.3, lambda: None)
        task = asyncio.create_task(health.watch())
        for _ in range(8):  # a scheduler that keeps talking is never stalled
            await asyncio.sleep(0.2)
            health.heard()
        assert health.error() is None
        start = time.monotonic()
        await asyncio.wait_for(task, 5.0)  # the watch ends once it has declared the stall
        return time.monotonic() - start, health.error()

    with caplog.at_level(logging.ERROR, logger="sglang.srt.managers.backend_health"):
        elapsed, error = asyncio.run(scenario())
    assert 0.3 + SCHEDULER_STALL_GRACE_S <= elapsed <= 0.3 + SCHEDULER_STALL_GRACE_S + 1.0
    assert error is not None and error.startswith("The scheduler has not answered for ")
    assert error.endswith("s (--watchdog-timeout 0.3 s).")
    assert [r.getMessage() for r in caplog.records] == [f"Watchdog: {error}"]


def test_a_dead_process_is_reported_instead_of_a_stall():
    async def scenario() -> BackendHealth:
        health = BackendHealth(0.1, lambda: "The scheduler process has exited (exit code 1).")
        task = asyncio.create_task(health.watch())
        await asyncio.sleep(0.1 + SCHEDULER_STALL_GRACE_S + 0.6)
        task.cancel()
        return health

    health = asyncio.run(scenario())
    assert health.stall is None
    assert health.error() == "The scheduler process has exited (exit code 1)."


def test_the_watchdog_is_off_with_a_timeout_of_zero():
    async def scenario() -> BackendHealth:
        health = BackendHealth(ServerArgs(watchdog_timeout=0).watchdog_seconds, lambda: None)
        await asyncio.wait_for(health.watch(), 1.0)  # returns at once
        health.last_heard -= 3600  # an hour of silence
        return health

    assert asyncio.run(scenario()).error() is None


def test_a_held_up_event_loop_is_not_taken_for_a_silent_scheduler():
    async def scenario() -> BackendHealth:
        health = BackendHealth(0.2, lambda: None)
        task = asyncio.create_task(health.watch())
        await asyncio.sleep(0)
        time.sleep(0.2 + SCHEDULER_STALL_GRACE_S + 0.3)  # this loop is held up (a blocking call)
        await asyncio.sleep(0.01)  # the watch runs its first check after the hold-up here...
        health.heard()  # ...before the receiver has read the heartbeats that arrived meanwhile
        await asyncio.sleep(0.3)
        task.cancel()
        return health

    assert asyncio.run(scenario()).error() is None


# ---- through the Engine and the HTTP app -----------------------------------------------------------


def consume_bounded(it, timeout: float) -> str:
    """Read a stream to its end on a thread; the BackendDeadError it ends with (fails if it hangs)."""
    out: dict = {}

    def run() -> None:
        try:
            for _ in it:
                pass
        except BackendDeadError as e:
            out["error"] = str(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"the request still waited {timeout:.0f} s after the scheduler stopped"
    assert "error" in out, "the stream ended without an error"
    return out["error"]


def test_a_stopped_scheduler_fails_requests_and_health_then_stops_quickly():
    with envs.SGLANG_TEST_FORWARD_DELAY_MS.override(20):
        eng = sglang.Engine(
            scheduler_entry=fake_scheduler.run_scheduler_process,
            model_path="tiny-qwen3-next",
            watchdog_timeout=1,
        )
    procs = list(eng._launched.processes)
    scheduler = procs[0].pid
    try:
        app = create_app(eng.server_args, eng.tokenizer_manager, eng._launched.model_info)
        assert eng._run(asgi_get(app, "/health")) == 200
        it = eng.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 3000}, stream=True)
        next(it)
        os.kill(scheduler, signal.SIGSTOP)
        stopped_at = time.monotonic()
        error = consume_bounded(it, 10.0)
        elapsed = time.monotonic() - stopped_at
        assert re.fullmatch(
            r"The scheduler has not answered for [\d.]+ s \(--watchdog-timeout 1 s\)\.", error
        )
        assert 1.0 <= elapsed <= 1.0 + SCHEDULER_STALL_GRACE_S + 2.5, elapsed
        assert eng._run(asgi_get(app, "/health")) == 503
        start = time.monotonic()
        assert eng._run(asgi_get(app, "/health_generate")) == 503
        with pytest.raises(BackendDeadError, match="has not answered"):
            eng.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 2})
        assert time.monotonic() - start < 1.0, "a stalled backend is refused at once, not waited on"
        start = time.monotonic()
        eng.shutdown()  # the stopped child is continued so that it takes its SIGTERM
        assert time.monotonic() - start < 3.0
        assert all(not p.is_alive() for p in procs)
    finally:
        if procs[0].is_alive():
            os.kill(scheduler, signal.SIGCONT)
        eng.shutdown()


# ---- process lifetime ------------------------------------------------------------------------------

PARENT = """
import multiprocessing as mp, time
from sglang.srt.entrypoints.process_launcher import child_main

def probe():
    print("watching", flush=True)
    time.sleep(600)

if __name__ == "__main__":
    # pdeathsig=False: only the parent watch can end the child.
    child = mp.get_context("spawn").Process(target=child_main, args=("probe", probe, False))
    child.start()
    print(child.pid, flush=True)
    time.sleep(600)
"""


def test_a_child_exits_with_its_parent_without_the_kernel_signal(tmp_path):
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "watching"
        parent.kill()
        parent.wait(5)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and _running(child):
            time.sleep(0.05)
        assert not _running(child), "the child outlived its parent"
    finally:
        if _running(child):
            os.kill(child, signal.SIGKILL)


def test_an_engine_started_on_a_short_lived_thread_keeps_its_children():
    box = {}
    thread = threading.Thread(
        target=lambda: box.setdefault(
            "eng",
            sglang.Engine(scheduler_entry=fake_scheduler.run_scheduler_process, model_path="tiny-qwen3-next"),
        )
    )
    thread.start()
    thread.join(60)
    eng = box["eng"]
    try:
        time.sleep(0.5)  # a parent-death signal tied to the finished thread would have fired by now
        assert all(p.is_alive() for p in eng._launched.processes)
        out = eng.generate(input_ids=[5, 6], sampling_params={"max_new_tokens": 3})
        assert out["meta_info"]["completion_tokens"] == 3
    finally:
        eng.shutdown()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
