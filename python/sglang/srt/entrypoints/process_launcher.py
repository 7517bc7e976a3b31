"""Start the scheduler and detokenizer processes and wait for their ready handshake.

Shared by the Engine and the HTTP server. The scheduler entry is a parameter so that tests can run the
whole front end against a fake scheduler (`sglang.test.fake_scheduler`) with the same protocol:

    scheduler_entry(server_args, port_args, pipe_writer)  # sends {"status": "ready", ...} or
                                                           # {"status": "error", "message": str}
                                                           # ("flag_error": True: the message is one
                                                           # sentence naming a flag, shown as is)

Every child exits when this process does, however it ends (`utils.child_process`). Flags this runtime
cannot honour are refused here, and flags kept only for compatibility are logged as having no effect,
so that the server and the Engine treat them alike.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.entrypoints import prestart
from sglang.srt.entrypoints.parallel_layout import plan_schedulers
from sglang.srt.managers.data_parallel_controller import run_data_parallel_controller_process
from sglang.srt.managers.detokenizer_manager import DetokenizerArgs, run_detokenizer_process
from sglang.srt.managers.io_struct import PortArgs
from sglang.srt.utils.child_process import exit_with_parent

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


# Transfer engines this server moves KV and state with (--disaggregation-transfer-backend).
TRANSFER_BACKENDS = ("mooncake", "nixl")
# Accepted so that upstream command lines run unchanged; each is logged once at startup with the reason.
NO_EFFECT_FLAGS = {
    "trust_remote_code": "models run on this runtime's own implementations and tokenizers load from "
    "local files, so no code from a checkpoint is ever run",
    "enable_torch_compile": "the forward runs eagerly: torch.compile is not built (on CPU, inductor "
    "measured 72 us against 67 us eager for one MoE block at these model sizes, and 56 us with "
    "cpp_wrapper after 4-8 s of compile per block: benchmark/README.md)",
    "torch_compile_max_bs": "torch.compile is not used (see --enable-torch-compile)",
    "constrained_json_whitespace_pattern": "upstream reads it for the outlines grammar backend only; "
    "xgrammar's JSON whitespace is set by --constrained-json-disable-any-whitespace",
    "collect_tokens_histogram": "the token histograms are always collected with --enable-metrics (as "
    "upstream's since it deprecated this flag); --prompt-tokens-buckets and --generation-tokens-buckets set them",
    "speculative_ngram_min_bfs_breadth": "NGRAM drafts are one chain (breadth 1): the most recent "
    "continuation of the longest matching suffix",
    "speculative_ngram_max_bfs_breadth": "NGRAM drafts are one chain (breadth 1): the most recent "
    "continuation of the longest matching suffix",
}


def check_flag_support(server_args: Any) -> None:
    """Refuse what this runtime cannot honour: ServerStartupError with one sentence naming the flag."""
    from sglang.srt.disaggregation import nixl_backend

    backend = server_args.disaggregation_transfer_backend
    if backend == "nixl" and nixl_backend.nixl_module() is None:
        raise ServerStartupError(
            "--disaggregation-transfer-backend nixl: NIXL is not installed here (none of its Python packages "
            "nixl, nixl_cu12, nixl_cu13 imports): pip install 'sglang[nixl]' (nixl-cu12), or use "
            "--disaggregation-transfer-backend mooncake."
        )
    if backend not in TRANSFER_BACKENDS:
        raise ServerStartupError(
            f"--disaggregation-transfer-backend {backend}: this server moves KV and state with mooncake "
            "or nixl only; use --disaggregation-transfer-backend mooncake."
        )
    if server_args.disaggregation_mode != "null" and server_args.device not in ("cpu", "cuda"):
        # CPU pools are registered as they are; CUDA pools directly (Mooncake's CUDA build) or through
        # pinned host staging buffers (disaggregation/staging.py).
        raise ServerStartupError(
            f"--disaggregation-mode {server_args.disaggregation_mode} with --device {server_args.device}: "
            "KV and state transfer is built for --device cpu and cuda only."
        )
    # --disaggregation-mode with --tp-size above 1: each rank moves its own shard, directly or through its
    # own staging buffers (disaggregation/pd_ranks.py). Across nodes each rank would name its transfer
    # engine by --host, node 0's address on every node: refused.
    if server_args.disaggregation_mode != "null" and server_args.nnodes > 1:
        raise ServerStartupError(
            f"--disaggregation-mode {server_args.disaggregation_mode} with --nnodes {server_args.nnodes}: "
            "prefill/decode disaggregation runs each server on one node; use --nnodes 1."
        )


def log_no_effect_flags(server_args: Any) -> None:
    defaults = _defaults(server_args)
    for name, reason in NO_EFFECT_FLAGS.items():
        if getattr(server_args, name) != defaults[name]:
            logger.warning("%s has no effect: %s.", _flag(name), reason)


def _defaults(server_args: Any) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(server_args)}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


@dataclass
class LaunchedProcesses:
    port_args: PortArgs
    model_info: dict[str, Any]
    processes: list[mp.process.BaseProcess] = field(default_factory=list)

    def failure(self) -> str | None:
        """Why the children cannot serve (one of them has exited), or None while all of them run."""
        if not self.processes:
            return "The scheduler and detokenizer processes have been stopped."
        dead = [proc for proc in self.processes if not proc.is_alive()]
        if not dead:
            return None
        # A rank killed by a signal takes the others down with it (their collectives fail): name it.
        proc = min(dead, key=lambda p: p.exitcode is None or p.exitcode >= 0)
        name, code = proc.name.removeprefix("sglang-"), proc.exitcode
        how = f"exit code {code}" if code is None or code >= 0 else f"killed by signal {-code}"
        return f"The {name} process has exited ({how})."

    def shutdown(self, timeout: float = 5.0) -> None:
        """Stop the children (terminate, then kill) and remove the IPC files. Idempotent."""
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
                _continue(proc)  # a stopped (SIGSTOP) child takes the SIGTERM only once it runs
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        self.processes = []
        self.port_args.remove_ipc_dir()  # (the data-parallel controller's sockets too)


def default_scheduler_entry() -> SchedulerEntry:
    from sglang.srt.managers.scheduler import run_scheduler_process

    return run_scheduler_process


def launch_subprocesses(
    server_args: Any, scheduler_entry: SchedulerEntry | None = None, startup_timeout: float = 600.0
) -> LaunchedProcesses:
    """Start the scheduler and the detokenizer; return once both are ready, with the scheduler's
    model info (`MODEL_INFO_KEYS`). Raises ServerStartupError (children already stopped) otherwise."""
    return start_subprocesses(server_args, scheduler_entry).wait_ready(startup_timeout)


@dataclass
class StartingProcesses:
    """Children started but not yet waited for: the caller may do its own start-up work meanwhile (the
    HTTP server imports its stack and loads the tokenizer while the scheduler imports torch and loads
    the model), then calls `wait_ready`, or `shutdown` if that work fails."""

    launched: LaunchedProcesses
    readers: list[tuple[str, mp.process.BaseProcess, Any]]

    def wait_ready(self, timeout: float = 600.0) -> LaunchedProcesses:
        """Every child's ready handshake, then the launched processes with the (first) scheduler's model
        info. Raises ServerStartupError (children already stopped) at the first child that fails."""
        launched = self.launched
        try:
            pending = list(self.readers)
            source = self.readers[0][0]  # TP rank 0 (of DP rank 0) on node 0: the model info
            deadline = time.monotonic() + timeout
            while pending:
                for item in pending[:]:
                    name, proc, reader = item
                    msg = _poll_ready(name, proc, reader)
                    if msg is None:
                        continue
                    pending.remove(item)
                    if name == source:
                        missing = [k for k in MODEL_INFO_KEYS if k not in msg]
                        if missing:
                            raise ServerStartupError(
                                f"The scheduler's ready message lacks {', '.join(missing)}."
                            )
                        launched.model_info = {k: v for k, v in msg.items() if k != "status"}
                if pending and time.monotonic() > deadline:
                    raise ServerStartupError(
                        f"The {pending[0][0]} process was not ready within {timeout:.0f} s."
                    )
                if pending:
                    mp.connection.wait([r for _, _, r in pending], timeout=0.2)
        except BaseException:
            launched.shutdown()
            raise
        logger.info(
            "Started %s.",
            ", ".join(f"the {p.name.removeprefix('sglang-')} (pid {p.pid})" for p in launched.processes),
        )
        return launched

    def shutdown(self) -> None:
        self.launched.shutdown()


def start_subprocesses(server_args: Any, scheduler_entry: SchedulerEntry | None = None) -> StartingProcesses:
    """Start the scheduler and the detokenizer, without waiting for them (`StartingProcesses`)."""
    check_flag_support(server_args)
    log_no_effect_flags(server_args)
    entry = scheduler_entry or default_scheduler_entry()
    port_args = PortArgs.init_new()
    specs, controller = plan_schedulers(server_args, port_args)
    ctx = mp.get_context("spawn")
    starting = StartingProcesses(LaunchedProcesses(port_args, {}), [])
    # The kernel's parent-death signal follows the starting thread: ask for it only when that thread
    # lives as long as this process (an Engine may be created on a short-lived thread).
    pdeathsig = threading.current_thread() is threading.main_thread()
    # (name, entry, its arguments: the flags (the detokenizer's few: `DetokenizerArgs`), port args, more)
    children: list[tuple[str, Callable, tuple]] = [
        (spec.name, entry, (server_args, spec.port_args) + (() if spec.rank is None else (spec.rank,)))
        for spec in specs
    ]
    if server_args.node_rank == 0:  # (another node runs its schedulers only: `serve_other_node`)
        children.append(("detokenizer", run_detokenizer_process, (DetokenizerArgs.of(server_args), port_args)))
    if controller is not None:
        args = (server_args, port_args, controller.replica_inputs, controller.reply_ipc)
        children.append(("data-parallel controller", run_data_parallel_controller_process, args))
    # (Timestamped: a start's log then says how long the children took to import and report.)
    logger.info("Starting the %s.", ", the ".join(name for name, _, _ in children))
    try:
        for name, target, args in children:
            # (a child spawned before the flags were checked, its imports done meanwhile: `prestart.py`)
            warm = prestart.take(name)  # (`assign` stops it if anything fails: no child goes astray)
            assigned = warm.assign(name, target, args[:2], args[2:]) if warm else None
            if assigned is not None:
                proc, reader = assigned
            else:
                reader, writer = ctx.Pipe(duplex=False)
                # The pipe's writer goes third, where every entry takes it (after the flags, port_args).
                child_args = (*args[:2], writer, *args[2:])
                proc = ctx.Process(
                    target=child_main, args=(name, target, pdeathsig, *child_args), name=f"sglang-{name}"
                )
                proc.start()
                writer.close()  # the child holds its own copy; EOF on the reader then means it is gone
            starting.launched.processes.append(proc)
            starting.readers.append((name, proc, reader))
    except BaseException:
        starting.shutdown()
        raise
    finally:
        prestart.release()  # (warm children this start had no use for)
    return starting


def child_main(name: str, target: Callable, pdeathsig: bool, *args: Any) -> None:
    """Entry of every child the launcher starts: tie its life to this process, then run `target`."""
    exit_with_parent(name, use_pdeathsig=pdeathsig)
    target(*args)


def _continue(proc: mp.process.BaseProcess) -> None:
    try:
        os.kill(proc.pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def _poll_ready(name: str, proc: mp.process.BaseProcess, reader: Any) -> dict[str, Any] | None:
    """The child's ready message if it has sent one; None while it starts; ServerStartupError (one
    sentence) if it failed or exited."""
    if reader.poll(0):
        try:
            msg = reader.recv()
        except EOFError:
            proc.join(2.0)
            raise ServerStartupError(
                f"The {name} process exited (code {proc.exitcode}) before it was ready; see its log above."
            ) from None
        if msg.get("status") == "ready":
            return msg
        if msg.get("flag_error"):
            raise ServerStartupError(msg["message"])  # one sentence that names the flag (or the rank)
        raise ServerStartupError(f"The {name} process failed to start: {msg.get('message', msg)}")
    if not proc.is_alive() and not reader.poll(0):
        raise ServerStartupError(
            f"The {name} process exited (code {proc.exitcode}) before it was ready; see its log above."
        )
    return None
