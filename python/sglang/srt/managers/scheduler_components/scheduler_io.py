"""The scheduler's I/O: ZMQ sockets in the scheduler process (or in-process sinks for tests), input
dispatch, the internal-state report, the process loop and `run_scheduler_process`."""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from sglang.srt.managers.io_struct import (
    AbortReq,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    PortArgs,
    TokenizedGenerateReqInput,
)

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50


class SchedulerIOMixin:
    def init_io(self: Scheduler, port_args: PortArgs | None = None) -> None:
        self.port_args = port_args
        # In-process sinks (tests, or before sockets exist): what would be sent to each process.
        self.detokenizer_outbox: list[Any] = []
        self.tokenizer_outbox: list[Any] = []
        self._sockets = None
        self._init_tokenizer()

    def connect(self: Scheduler, port_args: PortArgs) -> None:
        import zmq

        ctx = zmq.Context(2)
        self._parent_pid = os.getppid()
        recv = ctx.socket(zmq.PULL)
        recv.bind(port_args.scheduler_input_ipc_name)
        to_detok = ctx.socket(zmq.PUSH)
        to_tok = ctx.socket(zmq.PUSH)
        for sock in (recv, to_detok, to_tok):
            sock.setsockopt(zmq.LINGER, 0)
        to_detok.connect(port_args.detokenizer_ipc_name)
        to_tok.connect(port_args.tokenizer_ipc_name)
        self._sockets = (recv, to_detok, to_tok)

    def _init_tokenizer(self: Scheduler) -> None:
        """For stop strings and end-of-sequence ids."""
        cfg = self.server_args.model_config.hf_config
        eos = set()
        for value in (getattr(cfg, "eos_token_id", None), self._generation_config_eos()):
            if isinstance(value, int):
                eos.add(value)
            elif value:
                eos.update(value)
        self.tokenizer = None
        if not self.server_args.skip_tokenizer_init:
            from transformers import AutoTokenizer

            from sglang.srt.configs.presets import resolve_model_path

            self.tokenizer = AutoTokenizer.from_pretrained(
                resolve_model_path(self.server_args.tokenizer_path)
            )
            if self.tokenizer.eos_token_id is not None:
                eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos

    def _generation_config_eos(self: Scheduler):
        import json
        from pathlib import Path

        path = Path(self.server_args.model_config.path) / "generation_config.json"
        if not path.is_file():
            return None
        return json.loads(path.read_text()).get("eos_token_id")

    def match_stop_string(self: Scheduler, req: Req) -> str | None:
        if self.tokenizer is None:
            return None
        longest = max(len(s) for s in req.sampling_params.stop)
        tail = self.tokenizer.decode(req.output_ids[-(longest + 8) :], skip_special_tokens=False)
        return next((s for s in req.sampling_params.stop if s in tail), None)

    # ---- sending -----------------------------------------------------------------------------------

    def send_to_detokenizer(self: Scheduler, obj: Any) -> None:
        if self._sockets is None:
            self.detokenizer_outbox.append(obj)
        else:
            self._send(self._sockets[1], obj)

    def send_to_tokenizer(self: Scheduler, obj: Any) -> None:
        if self._sockets is None:
            self.tokenizer_outbox.append(obj)
        else:
            self._send(self._sockets[2], obj)

    def _send(self: Scheduler, sock, obj: Any) -> None:
        """Send without ever blocking for good: a peer that is gone would otherwise hang the scheduler
        in a send, where it never notices that its parent died."""
        import zmq

        while True:
            try:
                sock.send_pyobj(obj, zmq.NOBLOCK)
                return
            except zmq.Again:
                if sock.poll(100, zmq.POLLOUT):
                    continue
                if os.getppid() != self._parent_pid:
                    raise SystemExit("The parent process is gone; the scheduler exits.") from None

    # ---- receiving ---------------------------------------------------------------------------------

    def recv_requests(self: Scheduler, timeout_ms: int = 0) -> list[Any]:
        import zmq

        recv = self._sockets[0]
        out = []
        if timeout_ms and not recv.poll(timeout_ms):
            return out
        while True:
            try:
                out.append(recv.recv_pyobj(zmq.NOBLOCK))
            except zmq.ZMQError:
                return out

    def process_input_requests(self: Scheduler, reqs: list[Any]) -> None:
        for obj in reqs:
            if isinstance(obj, TokenizedGenerateReqInput):
                self.add_request(obj)
            elif isinstance(obj, AbortReq):
                self.abort_request(obj.rid, obj.abort_all, obj.message)
            elif isinstance(obj, FlushCacheReqInput):
                ok, msg = self.flush_cache()
                self.send_to_tokenizer(FlushCacheReqOutput(ok, msg))
            elif isinstance(obj, GetInternalStateReq):
                self.send_to_tokenizer(GetInternalStateReqOutput(self.get_internal_state()))
            else:
                logger.warning("The scheduler ignores an unknown message %r.", type(obj).__name__)

    # ---- state -------------------------------------------------------------------------------------

    def get_internal_state(self: Scheduler) -> dict[str, Any]:
        pool, kv, tree = self.req_to_token_pool, self.token_allocator, self.tree_cache
        reqs = self.live_requests()
        alloc = pool.mamba_allocator
        tree_kv, tree_slots = tree.total_size(), tree.mamba_total_size()
        return {
            "num_running_reqs": len(self.running) + (self.chunked_req is not None),
            "num_waiting_reqs": len(self.waiting_queue),
            "mamba_scheduler_strategy": self.server_args.mamba_scheduler_strategy,
            "mamba_strategy_reason": self.server_args.mamba_strategy_reason,
            "resident_slots_per_req": self.pool_sizes.resident_slots_per_req,
            "max_running_requests": self.max_running_requests,
            "max_total_num_tokens": kv.size,
            "token_usage": {
                "total": kv.size,
                "free": kv.available_size(),
                "held_by_requests": kv.size - kv.available_size() - tree_kv,
                "held_by_tree": tree_kv,
            },
            "mamba_usage": {
                "total": alloc.size,
                "free": alloc.free_list_size(),
                "held_by_requests": sum(len(pool.mamba_slots_of(r)) for r in reqs),
                "held_by_tree": tree_slots,
                "reserved_by_group": alloc.group_size(),
            },
            "lazy_alloc_failures": dict(self.tracker.lazy_alloc_failures),
            "counters": dict(self.counters),
        }

    # ---- process loop ------------------------------------------------------------------------------

    def event_loop(self: Scheduler) -> None:
        parent = self._parent_pid
        last_check = time.monotonic()
        busy = False
        while True:
            self.process_input_requests(self.recv_requests(0 if busy else IDLE_POLL_MS))
            busy = self.step()
            if time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                if os.getppid() != parent:
                    logger.info("The parent process is gone; the scheduler exits.")
                    return


def run_scheduler_process(server_args, port_args: PortArgs, pipe_writer) -> None:
    """Entry point of the scheduler process: load the model, report readiness, serve forever."""
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.utils.process import configure_subprocess

    configure_subprocess(server_args, "scheduler")
    try:
        sched = Scheduler(server_args)
        sched.connect(port_args)
    except Exception as e:  # noqa: BLE001 - the parent shows it as one startup error
        logger.exception("The scheduler failed to start.")
        pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    # Everything allocated so far (torch, transformers, the model) lives until exit: move it out of the
    # cyclic collector's reach, or each full collection walks it (~75 ms on the scheduler thread).
    gc.collect()
    gc.freeze()
    pipe_writer.send(
        {
            "status": "ready",
            "max_total_num_tokens": sched.token_allocator.size,
            "max_req_input_len": sched.max_req_input_len,
            "context_len": sched.context_len,
            "vocab_size": server_args.model_config.vocab_size,
            "max_running_requests": sched.max_running_requests,
            "max_mamba_cache_size": sched.pool_sizes.max_mamba_cache_size,
            "resident_slots_per_req": sched.pool_sizes.resident_slots_per_req,
            "mamba_scheduler_strategy": server_args.mamba_scheduler_strategy,
        }
    )
    try:
        sched.event_loop()
    finally:
        sched.shutdown()
    from sglang.srt.managers.scheduler import SchedulerWatchdogError

    except SchedulerWatchdogError as e:
        # The forward stream is stuck: nothing can be shut down cleanly. Exit non-zero at once; the
        # server sees its scheduler gone and stops.
        logger.error("Watchdog: %s The scheduler exits.", e)
        logging.shutdown()
        os._exit(1)
