"""The scheduler's I/O, a part of the `Scheduler` class kept in its own file (as upstream's scheduler
mixins): ZMQ sockets in the scheduler process (or in-process sinks for tests), intake and aborts, input
dispatch, the internal-state report and the process loop. It does not import `scheduler.py`; the
process entry `run_scheduler_process` lives there."""

from __future__ import annotations

import gc
import logging
import os
import time
from typing import Any

from sglang.srt.managers.io_struct import (
    HEARTBEAT_INTERVAL_S,
    AbortReq,
    BatchTokenizedGenerateReqInput,
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    ExpertDistributionReq,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    FreezeGCReq,
    FreezeGCReqOutput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    PortArgs,
    ProfileReq,
    SchedulerHeartbeat,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components import priority_scheduling as prio
from sglang.srt.managers.scheduler_components.loop_times import clock
from sglang.srt.managers.scheduler_components.request_control import GenerationPause, RequestDeadlines
from sglang.srt.managers.scheduler_components.scheduler_profiler_mixin import SchedulerProfilerMixin
from sglang.srt.managers.scheduler_components.tp_broadcast import Tick, TpBroadcast
from sglang.srt.sampling.custom_logit_processor import load_processor_agreed

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 50
# Tensor parallelism, while only grammars compile: how long rank 0 waits for a message per iteration.
GRAMMAR_WAIT_MS = 2
# While a KV transfer runs on its thread, the loop looks for its end this often.
DISAGG_TRANSFER_POLL_MS = 1


class SchedulerIOMixin(SchedulerProfilerMixin):
    def init_io(self, port_args: PortArgs | None = None) -> None:
        self.port_args = port_args
        # In-process sinks (tests, or before sockets exist): what would be sent to each process.
        self.detokenizer_outbox: list[Any] = []
        self.tokenizer_outbox: list[Any] = []
        self._sockets = None
        self._pd_poller = None
        self.tp: TpBroadcast | None = None  # tensor parallelism: rank 0's decisions reach every rank
        self._muted = False  # a TP rank other than 0: it sends nothing
        self._tick_aborts: list[tuple[list[str], str, int]] = []
        self.dp_rank: int | None = None  # data parallelism: this replica's rank (its load goes out)
        self.memory_bytes_by_rank: list[dict[str, int]] = []
        self._reported_load = -1
        self.request_deadlines = RequestDeadlines(self._request_views, self.abort_with_status)
        self.generation_pause = GenerationPause(self.retract_all)

    def connect(self, port_args: PortArgs) -> None:
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
        # /metrics' sglang:startup_time_seconds{phase="scheduler_e2e"}: from the model runner's start to
        # here, where the scheduler can take requests (the process's imports before are not counted).
        started = getattr(self.model_runner, "started_at", None)
        self.startup_e2e = None if started is None else time.monotonic() - started
        # A PD server's loop also wakes for the other server's messages (built once: the idle loop polls
        # every IDLE_POLL_MS).
        if self.disagg is not None:
            self._pd_poller = zmq.Poller()
            self._pd_poller.register(recv, zmq.POLLIN)
            self._pd_poller.register(self.disagg.channel.pull, zmq.POLLIN)

    def init_parallel(self, tp: TpBroadcast | None, dp_rank: int | None) -> None:
        """This scheduler's place among ranks: `tp` for one rank of a tensor-parallel group
        (`tp_broadcast.py`: rank 0 decides, the other ranks apply its decisions and send nothing; their
        pools must be sized alike), `dp_rank` for a data-parallel replica. Gathers each rank's memory on
        rank 0, which is also where every rank of the group is ready."""
        self.dp_rank = dp_rank
        memory = dict(getattr(self.model_runner, "memory_bytes", {}))
        self.memory_bytes_by_rank = [memory]
        if tp is None:
            return
        tp.agree(
            self.pool_sizes,
            "pool sizes",
            "; give --max-total-tokens and --max-mamba-cache-size so that every rank sizes its pools alike",
        )
        self.memory_bytes_by_rank = tp.gather(memory)
        self.tp = tp
        # The ranks agree on the output checks' measures (finish_checker.py) and on failed grammar compiles.
        self.finisher.group = self.grammar_queue.group = tp.group
        if tp.is_first:
            self.request_deadlines.abort = self._record_deadline_abort
        else:
            self._muted = True
            self.request_deadlines.enabled = False

    def _record_deadline_abort(self, reqs: list[Req], message: str, status: int) -> None:
        self._tick_aborts.append(([r.rid for r in reqs], message, status))

    # ---- sending -----------------------------------------------------------------------------------

    def send_to_detokenizer(self, obj: Any) -> None:
        if self._muted:
            return
        if self._sockets is None:
            self.detokenizer_outbox.append(obj)
        else:
            self._send(self._sockets[1], obj)

    def send_to_tokenizer(self, obj: Any) -> None:
        if self._muted:
            return
        if self.dp_rank is not None:  # (to the data-parallel controller, which needs to know whose it is)
            from sglang.srt.managers.data_parallel_controller import FromReplica

            obj = FromReplica(self.dp_rank, obj)
        if self._sockets is None:
            self.tokenizer_outbox.append(obj)
        else:
            self._send(self._sockets[2], obj)

    def _send(self, sock, obj: Any) -> None:
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

    def recv_requests(self, timeout_ms: int = 0) -> list[Any]:
        import zmq

        recv = self._sockets[0]
        out = []
        if timeout_ms:
            if self._pd_poller is None or self.generation_pause.paused:
                # (paused: the PD queues wait too, so their messages must not wake the loop)
                if not recv.poll(timeout_ms):
                    return out
            else:
                if self.disagg.transfers_running():  # a transfer ending on its thread wakes nothing
                    timeout_ms = min(timeout_ms, DISAGG_TRANSFER_POLL_MS)
                if not dict(self._pd_poller.poll(timeout_ms)).get(recv):
                    return out
        while True:
            try:
                out.append(recv.recv_pyobj(zmq.NOBLOCK))
            except zmq.ZMQError:
                return out

    def process_input_requests(self, reqs: list[Any]) -> None:
        for obj in reqs:
            if isinstance(obj, TokenizedGenerateReqInput):
                self.request_deadlines.on_arrival(obj.rid)
                self.add_request(obj)
            elif isinstance(obj, BatchTokenizedGenerateReqInput):
                self.process_input_requests(obj.batch)
            elif isinstance(obj, AbortReq):
                self.abort_request(obj.rid, obj.abort_all, obj.message)
            elif isinstance(obj, FlushCacheReqInput):
                ok, msg = self.flush_cache()
                if ok and obj.end_of_warmup:
                    self.reset_counts()
                self.send_to_tokenizer(FlushCacheReqOutput(ok, msg))
            elif isinstance(obj, GetInternalStateReq):
                self.send_to_tokenizer(GetInternalStateReqOutput(self.get_internal_state()))
            elif isinstance(obj, PauseGenerationReqInput):
                self.generation_pause.pause(obj.mode)
                self.send_to_tokenizer(PauseGenerationReqOutput())
            elif isinstance(obj, ContinueGenerationReqInput):
                self.generation_pause.resume()
                self.send_to_tokenizer(ContinueGenerationReqOutput())
            elif isinstance(obj, FreezeGCReq):
                gc.freeze()
                self.send_to_detokenizer(obj)  # (which has no other way in)
                self.send_to_tokenizer(FreezeGCReqOutput(True, f"{gc.get_freeze_count()} objects frozen."))
            elif isinstance(obj, ExpertDistributionReq):
                self.send_to_tokenizer(self.expert_distribution(obj.action))
            elif isinstance(obj, ProfileReq):
                self.send_to_tokenizer(self.profile(obj))
            elif not (self.process_weights_message(obj) or self.process_lora_message(obj)):
                logger.warning("The scheduler ignores an unknown message %r.", type(obj).__name__)

    # ---- intake and aborts -----------------------------------------------------------------------

    def add_request(self, recv: TokenizedGenerateReqInput) -> Req:
        req = Req(
            recv.rid,
            recv.input_ids,
            recv.sampling_params,
            return_logprob=recv.return_logprob,
            logprob_start_len=recv.logprob_start_len,
            top_logprobs_num=recv.top_logprobs_num,
            token_ids_logprob=recv.token_ids_logprob,
            stream=recv.stream,
        )
        req.bootstrap = recv.bootstrap
        req.extra_key, req.lora_id = recv.extra_key, recv.lora_id
        req.priority, req.require_reasoning = recv.priority, recv.require_reasoning
        if recv.warmup:
            self.tree_cache.keep_off_host(recv.extra_key)
        req.return_hidden_states, req.return_routed_experts = recv.return_hidden_states, recv.return_routed_experts
        req.multimodal_inputs = recv.mm_inputs
        req.inflight = self.inflight
        self.counters["num_requests_total"] += 1
        error = self._validate(req)
        if error is not None:
            req.finished_reason = {"type": "abort", "message": error}
            self.result_processor.send_finished([req])
            if req.bootstrap is not None and self.disagg is not None:
                self.disagg.on_released(req)
            return req
        self.counters["num_prompt_tokens_total"] += len(req.origin_input_ids)
        self.reqs_by_rid[req.rid] = req
        if req.priority is not None and self.priority is None and self.server_args.abort_on_priority_when_disabled:
            self.abort_with_status([req], prio.PRIORITY_DISABLED, 503)
            return req
        if recv.custom_logit_processor is not None:
            agree = self.tp.agree_outcome if self.tp is not None else None  # (the ranks refuse it alike)
            processor, error = load_processor_agreed(recv.custom_logit_processor, agree)
            if error is not None:
                self.refuse_request(req, error, "custom_logit_processor")
                return req
            req.custom_logit_processor = processor
            self.custom_logit_reqs += 1
        if req.penalized:  # (after the processor: with one, the quick check checks every token)
            self.finisher.set_quick_check(req)  # its stop ids, which min_new_tokens bans until then
        if not self.grammar_queue.add(req):  # (one with a grammar comes back once it is compiled)
            self.admit_request(req)
        return req

    def admit_request(self, req: Req) -> None:
        """Queue a request that is ready to be scheduled."""
        if req.grammar is not None:
            self.finisher.set_quick_check(req)  # its grammar follows every token
        if req.bootstrap is not None and self.disaggregation_mode == "decode":
            self.disagg.add(req)  # its prompt's KV and state come from the prefill server
            return
        # --max-queued-requests (not under PD, as upstream): `priority_scheduling.queue_overflow`.
        limit = self.server_args.max_queued_requests if self.disaggregation_mode == "null" else None
        dropped = prio.queue_overflow(limit, self.priority, self.waiting_queue, req)
        if dropped is not req:
            self.waiting_queue.append(req)
        if dropped is not None:
            if dropped is not req:
                self.waiting_queue.remove(dropped)
            self.abort_with_status([dropped], prio.QUEUE_FULL if dropped is req else prio.OUTRANKED_IN_QUEUE, 503)

    def refuse_request(self, req: Req, message: str, param: str) -> None:
        """End a queued request with a 400 naming the request field `param`."""
        self.abort_with_status([req], message, 400, param)

    def _validate(self, req: Req) -> str | None:
        n = len(req.origin_input_ids)
        if n == 0:
            return "The input is empty."
        if n > self.max_req_input_len:
            return f"The input ({n} tokens) is longer than the limit of {self.max_req_input_len} tokens."
        if req.rid in self.reqs_by_rid:
            return f"A request with rid {req.rid!r} is already running."
        return self.lora_refusal(req)

    def abort_request(self, rid: str = "", abort_all: bool = False, message: str = "Aborted.") -> None:
        targets = list(self.reqs_by_rid.values()) if abort_all else [self.reqs_by_rid.get(rid)]
        self.abort_with_status([r for r in targets if r is not None and not r.finished], message)

    def abort_with_status(
        self, reqs: list[Req], message: str, status_code: int | None = None, param: str | None = None
    ) -> None:
        """Finish `reqs` as aborted by the server, releasing what they hold; with `status_code` the client
        gets that HTTP status (and with `param` an error naming that request field)."""
        for req in reqs:
            req.finished_reason = {"type": "abort", "message": message}
            if status_code is not None:
                req.finished_reason["status_code"] = status_code
            if param is not None:
                req.finished_reason["param"] = param
            if req.bootstrap is not None and self.disagg is not None and self.disagg.defer_release(req):
                continue  # a transfer still uses what it holds; released when the transfer ends
            self.result_processor.release_finished(req)
        self.result_processor.send_finished(reqs)

    def _request_views(self) -> tuple[list[Req], list[Req], dict[str, Req]]:
        running = list(self.running) + ([self.chunked_req] if self.chunked_req is not None else [])
        waiting = self.waiting_queue
        if self.grammar_queue:
            waiting = waiting + self.grammar_queue.requests  # (one whose grammar compiles waits too)
        return waiting, running, self.reqs_by_rid

    # ---- state -------------------------------------------------------------------------------------

    def get_internal_state(self) -> dict[str, Any]:
        pool, kv, tree = self.req_to_token_pool, self.token_allocator, self.tree_cache
        reqs = self.live_requests()
        alloc = pool.mamba_allocator
        tree_kv, tree_slots = tree.total_size(), tree.mamba_total_size()
        return {
            "num_running_reqs": len(self.running) + (self.chunked_req is not None),
            "num_waiting_reqs": len(self.waiting_queue),
            "num_waiting_tokens": sum(len(r.origin_input_ids) for r in self.waiting_queue),
            "num_batches": self.num_batches,  # (the count /start_profile's start_step names)
            "num_grammar_queue_reqs": len(self.grammar_queue),
            "mamba_scheduler_strategy": self.server_args.mamba_scheduler_strategy,
            "mamba_strategy_reason": self.server_args.mamba_strategy_reason,
            "resident_slots_per_req": self.pool_sizes.resident_slots_per_req,
            "tree_headroom_slots_per_req": self.server_args.mamba_strategy.tree_headroom,
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
            "memory_released": sorted(self.model_runner.memory_occupation.released),
            "counters": dict(self.counters),
            "loop_times": self.loop_times.report(self.worker.busy_seconds),
            "disaggregation_mode": self.disaggregation_mode,
            "disaggregation": self.disagg.state() if self.disagg is not None else None,
            # --enable-hierarchical-cache: the host tier's counts (loads, backups, disk reads and writes).
            "hicache": dict(tree.controller.stats) if hasattr(tree, "controller") else None,
            **(self.spec.internal_state() if self.spec is not None else {}),
            **self.batch_stats.metrics_state(),
            "process_cpu_seconds": time.process_time(),
            "startup_times": self._startup_times(),
            "memory_bytes": dict(getattr(self.model_runner, "memory_bytes", {})),
            # Each TP rank's weights, KV pool and state pool (rank 0's alone without TP).
            "memory_bytes_by_rank": self.memory_bytes_by_rank
            or [dict(getattr(self.model_runner, "memory_bytes", {}))],
        }

    def _startup_times(self) -> dict[str, float]:
        times = dict(getattr(self.model_runner, "startup_times", {}))
        if getattr(self, "startup_e2e", None) is not None:
            times["scheduler_e2e"] = self.startup_e2e
        return times

    # ---- process loop ------------------------------------------------------------------------------

    def event_loop(self) -> None:
        # The launcher makes this process exit with its parent. The heartbeat, sent just before a step
        # (which may wait up to --watchdog-timeout for a forward), tells the parent that this loop runs.
        last_beat = 0.0
        busy = False
        while True:
            times, start = self.loop_times, clock()
            if self.tp is None:
                msgs = self.recv_requests(0 if busy else IDLE_POLL_MS)
                received = clock()
                self.process_input_requests(msgs)
                if self.weight_update.pending is not None:
                    self.finish_weight_update()
            else:
                tick = self.tp.exchange(self._make_tick(busy) if self.tp.is_first else None)
                received = clock()
                self.apply_tick(tick)
            if self.weights_groups.pending is not None:
                self.finish_weights_group_op()
            times.idle += received - start
            times.intake += clock() - received
            now = time.monotonic()
            if now - last_beat >= HEARTBEAT_INTERVAL_S:
                last_beat = now
                self.send_to_tokenizer(SchedulerHeartbeat())
            busy = False
            # (While memory is released, the model and its pools cannot run: new requests wait.)
            if self._may_run():
                if self.tp is None:
                    self.request_deadlines.check()
                busy = self.step()
            if self.dp_rank is not None:
                self._report_load()

    def _may_run(self) -> bool:
        return not self.generation_pause.paused and not self.model_runner.memory_occupation.released

    # ---- tensor and data parallelism -------------------------------------------------------------

    def _make_tick(self, busy: bool) -> Tick:
        """Rank 0: the new messages and this iteration's decisions that depend on time."""
        # Only grammars compiling: wait a little for one (or a message) rather than spin the ranks.
        only_grammars = self.grammar_queue and not (
            self.running or self.waiting_queue or self.in_flight or self.chunked_req
        )
        msgs = self.recv_requests(GRAMMAR_WAIT_MS if only_grammars else 0 if busy else IDLE_POLL_MS)
        if self._may_run():
            self.request_deadlines.check()  # (into `_tick_aborts`)
        aborts, self._tick_aborts = self._tick_aborts, []
        pending = self.weight_update.pending
        return Tick(
            grammars=self.grammar_queue.settled() if self.grammar_queue else [],
            deadline_aborts=aborts,
            weights_loaded=pending is not None and pending[1].done(),
            messages=msgs,
            disagg=None if self.disagg is None else (self.disagg.has_news(), time.monotonic()),
        )

    def apply_tick(self, tick: Tick) -> None:
        """Every rank, rank 0 too: the same decisions in the same order (the PD queue's clock first: a
        room the tick's aborts or messages end is stamped with this iteration's)."""
        if tick.disagg is not None:
            self.disagg.news, self.disagg.now = tick.disagg
        self.grammar_queue.apply(tick.grammars)
        for rids, message, status in tick.deadline_aborts:
            self.abort_with_status(
                [self.reqs_by_rid[r] for r in rids if r in self.reqs_by_rid], message, status
            )
        if tick.weights_loaded and self.weight_update.pending is not None:
            self.weight_update.pending[1].exception()  # (waits for this rank's load to end too)
            self.finish_weight_update()
        self.process_input_requests(tick.messages)

    def rank_digest(self) -> tuple:
        """What every TP rank must agree on whenever it goes idle: batches built and the pools' counts
        (with a host tier, its tree's too)."""
        tree = self.tree_cache
        host = getattr(tree, "host_tree", None)
        return (
            self.num_batches,
            self.token_allocator.available_size(),
            self.req_to_token_pool.mamba_allocator.free_list_size(),
            tree.total_size(),
            tree.mamba_total_size(),
            tuple(sorted(self.counters.items())),
            None if host is None else (host.total_size(), host.mamba_total_size()),
        )

    def _report_load(self) -> None:
        """A data-parallel replica tells the controller how many requests it holds, when that changes
        (--load-balance-method shortest_queue)."""
        from sglang.srt.managers.data_parallel_controller import ReplicaLoad

        load = len(self.reqs_by_rid)
        if load != self._reported_load:
            self._reported_load = load
            self.send_to_tokenizer(ReplicaLoad(self.dp_rank, load))
