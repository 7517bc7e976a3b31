"""Start the scheduler and detokenizer processes and wait for their ready handshake.

Shared by the Engine and the HTTP server. The scheduler entry is a parameter so that tests can run the
whole front end against a fake scheduler (`sglang.test.fake_scheduler`) with the same protocol:

    scheduler_entry(server_args, port_args, pipe_writer)  # sends {"status": "ready", ...} or
                                                           # {"status": "error", "message": str}
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.managers.detokenizer_manager import run_detokenizer_process
from sglang.srt.managers.io_struct import PortArgs

logger = logging.getLogger(__name__)

SchedulerEntry = Callable[[Any, PortArgs, Any], None]
MODEL_INFO_KEYS = (
    "max_total_num_tokens",
    "max_req_input_len",
    "context_len",
    "vocab_size",
    "max_running_requests",
)


class ServerStartupError(RuntimeError):
    """A child process failed to start; the message says which and why, in one sentence."""


@dataclass
class LaunchedProcesses:
    port_args: PortArgs
    model_info: dict[str, Any]
    processes: list[mp.process.BaseProcess] = field(default_factory=list)

    def all_alive(self) -> bool:
        return bool(self.processes) and all(p.is_alive() for p in self.processes)

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the children (terminate, then kill) and remove the IPC files. Idempotent."""
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self.processes = []
        for name in (
            self.port_args.tokenizer_ipc_name,
            self.port_args.scheduler_input_ipc_name,
            self.port_args.detokenizer_ipc_name,
        ):
            try:
                os.unlink(name.removeprefix("ipc://"))
            except OSError:
                pass


def default_scheduler_entry() -> SchedulerEntry:
    from sglang.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process


def launch_subprocesses(
    server_args: Any, scheduler_entry: SchedulerEntry | None = None, startup_timeout: float = 600.0
) -> LaunchedProcesses:
    """Start the scheduler and the detokenizer; return once both are ready, with the scheduler's
    model info (`MODEL_INFO_KEYS`). Raises ServerStartupError (children already stopped) otherwise."""
    if server_args.disaggregation_mode != "null":
        # Refused here, so that the server and the Engine both refuse it.
        raise ServerStartupError(
            f"--disaggregation-mode {server_args.disaggregation_mode}: disaggregated prefill/decode serving "
            "is not available yet; start without --disaggregation-mode."
        )
    entry = scheduler_entry or default_scheduler_entry()
    port_args = PortArgs.init_new()
    ctx = mp.get_context("spawn")
    launched = LaunchedProcesses(port_args, {})
    waits = []
    for name, target in (("scheduler", entry), ("detokenizer", run_detokenizer_process)):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(server_args, port_args, writer), name=f"sglang-{name}")
        proc.start()
        writer.close()  # the child holds its own copy; EOF on the reader then means the child is gone
        launched.processes.append(proc)
        waits.append((name, proc, reader))
    try:
        for name, proc, reader in waits:
            msg = _wait_ready(name, proc, reader, startup_timeout)
            if name == "scheduler":
                missing = [k for k in MODEL_INFO_KEYS if k not in msg]
                if missing:
                    raise ServerStartupError(f"The scheduler's ready message lacks {', '.join(missing)}.")
                launched.model_info = {k: v for k, v in msg.items() if k != "status"}
    except BaseException:
        launched.shutdown()
        raise
    return launched


def _wait_ready(name: str, proc: mp.process.BaseProcess, reader: Any, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if reader.poll(0.2):
            try:
                msg = reader.recv()
            except EOFError:
                proc.join(2.0)
                raise ServerStartupError(
                    f"The {name} process exited (code {proc.exitcode}) before it was ready; see its log above."
                ) from None
            if msg.get("status") == "ready":
                return msg
            raise ServerStartupError(f"The {name} process failed to start: {msg.get('message', msg)}")
        if not proc.is_alive() and not reader.poll(0):
            raise ServerStartupError(
                f"The {name} process exited (code {proc.exitcode}) before it was ready; see its log above."
            )
    raise ServerStartupError(f"The {name} process was not ready within {timeout:.0f} s.")
