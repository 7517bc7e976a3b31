"""`sglang-router` in PD mode as a subprocess, in front of a prefill and a decode server (tests and
benchmark/bench_pd.py): `python -m sglang_router.launch_router --pd-disaggregation --prefill URL PORT
--decode URL`, loopback only, the hub unreachable on purpose."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from sglang.test.test_utils import ServerProcess, find_free_port


class RouterProcess:
    def __init__(
        self, prefill: ServerProcess, bootstrap_port: int, decode: ServerProcess, extra_args: list[str] = ()
    ):
        self.port = find_free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="sglang-router-", suffix=".log", delete=False)
        cmd = [
            sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
            "--prefill", prefill.base_url, str(bootstrap_port), "--decode", decode.base_url,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(find_free_port()),
            "--worker-startup-check-interval", "1", "--log-level", "warn", *extra_args,
        ]  # fmt: skip
        # The router loads a tokenizer for each worker's model path (give the servers a local folder);
        # should it try the hub anyway, the hub is unreachable.
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    def log_text(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def wait_ready(self, timeout: float = 60) -> None:
        """Until both workers are registered (the router answers /workers with their URLs)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"The router exited with {self.proc.returncode}:\n{self.log_text()[-3000:]}"
                )
            try:
                if requests.get(self.base_url + "/workers", timeout=1).text.count('"url"') >= 2:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.3)
        raise RuntimeError("The router did not register both workers:\n" + self.log_text()[-3000:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)


def start_pd(
    model_path: str,
    prefill_args: list[str] = (),
    decode_args: list[str] = (),
    prefill_env: dict[str, str] | None = None,
    decode_env: dict[str, str] | None = None,
    router_args: list[str] = (),
) -> tuple[ServerProcess, ServerProcess, RouterProcess, int]:
    """A prefill server, a decode server and the router (given `router_args` besides its own) in front,
    all ready; (prefill, decode, router, bootstrap port). The caller stops them (`stop_all`)."""
    bootstrap_port = find_free_port()
    prefill = ServerProcess(
        ["--model-path", model_path, "--disaggregation-mode", "prefill",
         "--disaggregation-bootstrap-port", str(bootstrap_port), *prefill_args],
        env=prefill_env,
    )  # fmt: skip
    decode = ServerProcess(
        ["--model-path", model_path, "--disaggregation-mode", "decode", *decode_args], env=decode_env
    )
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router = RouterProcess(prefill, bootstrap_port, decode, router_args)
        router.wait_ready()
    except BaseException:
        stop_all(prefill, decode, router)
        raise
    return prefill, decode, router, bootstrap_port


def stop_all(*procs) -> None:
    for p in procs:
        if p is not None:
            p.stop()
