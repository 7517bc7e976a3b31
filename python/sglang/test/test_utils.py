"""Server tests: start a real `sglang.launch_server` subprocess on a free port and talk HTTP to it.

    class TestMyServer(ServerTestCase):
        server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy"]
        env = {"SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL": "1"}

        def test_x(self):
            out = self.generate(input_ids=[5, 6, 7], sampling_params={"max_new_tokens": 4})

Front-end unit tests that need a scripted scheduler use `sglang.test.fake_scheduler` through
`sglang.Engine(scheduler_entry=...)` instead.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any

import requests

STARTUP_TIMEOUT_S = 180.0
IDLE_TIMEOUT_S = 30.0


# Marks of Python source that prose in any language lacks; `looks_like_python` wants several of them.
PYTHON_MARKS = ("def ", "return", "self", "import ", "None", " = ", "):", "\n    ", '"""', "if ", "()", "==")


def looks_like_python(text: str) -> bool:
    """What the demo model should write (it learned Python from the standard library): printable ASCII,
    ASCII identifier-or-operator words, and several marks of Python source (not just prose)."""
    if not text or not all(c.isascii() and (c.isprintable() or c in "\n\t") for c in text):
        return False
    words = text.split()
    shaped = sum(bool(re.fullmatch(r"[\w.()\[\],:=+\-*/'\"<>!%{}#@]+", w, re.ASCII)) for w in words)
    marks = sum(mark in text for mark in PYTHON_MARKS)
    return len(words) >= 5 and shaped / len(words) > 0.8 and marks >= 3


def find_free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flag_value(args: list[str], flag: str) -> str | None:
    """A flag's value in a command line (`--flag value` or `--flag=value`), or None."""
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


class ServerProcess:
    """One server subprocess; output goes to a log file shown when startup fails."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str] | None = None,
        port: int | None = None,
        api_key: str | None = None,
    ):
        self.port = port or find_free_port()
        # --ssl-certfile: HTTPS, its certificate verified (it must name 127.0.0.1).
        self.verify = _flag_value([*args, *shlex.split(os.environ.get("SGLANG_TEST_SERVER_ARGS", ""))],
                                  "--ssl-certfile") or True  # fmt: skip
        self.base_url = f"{'http' if self.verify is True else 'https'}://127.0.0.1:{self.port}"
        self.api_key = api_key
        # SGLANG_TEST_SERVER_ARGS: flags every test server gets too (the nightly run of the server tests
        # with --tp-size 2: test/registered/distributed/test_e2e_tp2_nightly.py).
        extra = shlex.split(os.environ.get("SGLANG_TEST_SERVER_ARGS", ""))
        argv = [*args, *extra, "--host", "127.0.0.1", "--port", str(self.port)]
        if api_key:
            argv += ["--api-key", api_key]
        cmd = [sys.executable, "-m", "sglang.launch_server", *argv]
        self.log = tempfile.NamedTemporaryFile(prefix="sglang-server-", suffix=".log", delete=False)
        full_env = {**os.environ, **(env or {})}
        # Its own process group, so that stop() can take down the subprocesses too if it must kill.
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=full_env, start_new_session=True
        )

    def log_text(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"The server exited with {self.proc.returncode}:\n{self.log_text()[-4000:]}"
                )
            try:
                if requests.get(self.base_url + "/health", timeout=1, verify=self.verify).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        log = self.log_text()[-4000:]
        self.stop()
        raise RuntimeError(f"The server was not healthy within {timeout:.0f} s:\n{log}")

    def stop(self) -> None:
        """SIGTERM (the server stops its subprocesses), then SIGKILL to the whole group."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever is left of the group
        except ProcessLookupError:
            pass
        self.proc.wait(5)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)  # stop() may run twice (timeout, then teardown)


class ServerTestCase(unittest.TestCase):
    model = "tiny-qwen3-next"
    server_args: list[str] = []
    env: dict[str, str] = {}
    api_key: str | None = None

    @classmethod
    def prepare(cls, folder: Path) -> None:
        """Before the server starts: make what the class needs in `folder` (`cls.workdir`, a temporary
        folder that lives as long as the class), e.g. a checkpoint to serve as `cls.model`."""

    @classmethod
    def setUpClass(cls) -> None:
        cls._workdir = tempfile.TemporaryDirectory()
        cls.workdir = Path(cls._workdir.name)
        try:
            cls.prepare(cls.workdir)
            cls.server = ServerProcess(
                ["--model-path", cls.model, *cls.server_args], cls.env, api_key=cls.api_key
            )
        except BaseException:
            cls._workdir.cleanup()
            raise
        try:
            cls.server.wait_ready()
        except BaseException:
            cls.server.stop()
            cls._workdir.cleanup()
            raise
        cls.base_url = cls.server.base_url

    @classmethod
    def tearDownClass(cls) -> None:
        cls.server.stop()
        cls._workdir.cleanup()

    # ---- HTTP helpers --------------------------------------------------------------------------

    @classmethod
    def headers(cls) -> dict[str, str]:
        return {"Authorization": f"Bearer {cls.api_key}"} if cls.api_key else {}

    def post(self, path: str, body: Any = None, timeout: float = 120, **kw: Any) -> requests.Response:
        headers = {**self.headers(), **kw.pop("headers", {})}
        kw.setdefault("verify", self.server.verify)
        return requests.post(self.base_url + path, json=body, headers=headers, timeout=timeout, **kw)

    def get(self, path: str, timeout: float = 30) -> requests.Response:
        return requests.get(self.base_url + path, headers=self.headers(), timeout=timeout, verify=self.server.verify)

    def generate(self, **body: Any) -> Any:
        r = self.post("/generate", body)
        self.assertEqual(r.status_code, 200, r.text)
        return r.json()

    def flush_cache(self) -> None:
        # flush_cache is refused while requests run; a test calls it between requests, so retry briefly.
        for _ in range(50):
            if self.post("/flush_cache").status_code == 200:
                return
            time.sleep(0.1)
        self.fail("flush_cache kept failing")

    def internal_state(self) -> dict[str, Any]:
        r = self.get("/get_server_info")
        self.assertEqual(r.status_code, 200, r.text)
        return r.json()["internal_states"][0]

    def wait_idle(self, timeout: float = IDLE_TIMEOUT_S) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            state = self.internal_state()
            if state["num_running_reqs"] == 0 and state["num_waiting_reqs"] == 0:
                return state
            if time.monotonic() > deadline:
                self.fail(f"the server did not go idle within {timeout:.0f} s: {state}")
            time.sleep(0.1)

    def assert_idle_accounting(self) -> dict[str, Any]:
        """Once idle: nothing held by requests, and free + held by the tree == total, for both pools."""
        state = self.wait_idle()
        for pool in ("token_usage", "mamba_usage"):
            usage = state[pool]
            self.assertEqual(usage["held_by_requests"], 0, f"{pool}: {usage}")
            self.assertEqual(usage["free"] + usage["held_by_tree"], usage["total"], f"{pool}: {usage}")
        self.assertEqual(state["mamba_usage"].get("reserved_by_group", 0), 0, state["mamba_usage"])
        return state
