"""The scheduler: owns the pools' bookkeeping, the radix cache and the request queues, builds batches
and runs the event loop. It never reads or writes a state or KV tensor: every such write runs on the
forward stream (`ForwardWorker`).

Overlap loop (default): launch batch N on the forward stream, then process the result of N-1, so the
scheduler's work hides behind the forward. Without overlap each batch is processed right after it ran.
While a request holding a grammar's matcher or a custom logit processor runs, every batch in flight is
processed before the next is built (its mask, or its processor, needs the tokens they sampled): the
forward then overlaps nothing.
"""

from __future__ import annotations

import gc
import logging
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future

from sglang.srt.constrained.reasoning_grammar import ReasoningTokens
from sglang.srt.constrained.xgrammar_backend import create_grammar_backend
from sglang.srt.environ import envs
from sglang.srt.managers.finish_checker import FinishChecker
from sglang.srt.managers.io_struct import PortArgs
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.schedule_policy import AdmissionBudget, PrefillAdder, SchedulePolicy
from sglang.srt.managers.scheduler_components.batch_result_processor import BatchResultProcessor
from sglang.srt.managers.scheduler_components.batch_stats_log import BatchStatsLog
from sglang.srt.managers.scheduler_components.decode_fast_path import DecodeFastPath
from sglang.srt.managers.scheduler_components.grammar_queue import GrammarQueue
from sglang.srt.managers.scheduler_components.inflight_batches import InflightBatches
from sglang.srt.managers.scheduler_components.loop_times import LoopTimes, clock
from sglang.srt.managers.scheduler_components.mamba_tracking import MambaTracker
from sglang.srt.managers.scheduler_components.mixed_chunk import mixed_prefill_tokens, take_decode_rows
from sglang.srt.managers.scheduler_components.priority_scheduling import PriorityRule
from sglang.srt.managers.scheduler_components.scheduler_io import SchedulerIOMixin
from sglang.srt.managers.scheduler_components.scheduler_lifecycle import SchedulerLifecycleMixin
from sglang.srt.managers.scheduler_components.scheduler_lora_mixin import SchedulerLoRAMixin
from sglang.srt.managers.scheduler_components.scheduler_profiler import SchedulerProfiler
from sglang.srt.managers.scheduler_components.scheduler_update_weights_mixin import (
    SchedulerUpdateWeightsMixin,
)
from sglang.srt.managers.scheduler_components.scheduler_watchdog import (
    SchedulerWatchdogError,
    exit_now,
    wait_forward,
    watch_inline_forward,
)
from sglang.srt.managers.scheduler_components.tp_broadcast import (
    ParallelGroupError,
    ParallelRank,
    join_parallel_group,
)
from sglang.srt.managers.scheduler_components.tree_cache_factory import create_tree_cache
from sglang.srt.managers.scheduler_components.weight_update import WeightUpdate
from sglang.srt.managers.scheduler_components.weights_update_group import WeightsUpdateGroups
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.common import alloc_for_decode
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.forward_worker import (
    ForwardWorker,
    LaunchedBatch,
    pre_forward_ops,
    run_state_ops_here,
)
from sglang.srt.sampling.penaltylib import PenaltySlots
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.utils.host_profile import host_profile

logger = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerWatchdogError", "run_scheduler_process"]

# How long a step with nothing else to do waits for a grammar being compiled.
GRAMMAR_POLL_S = 0.002


class Scheduler(SchedulerIOMixin, SchedulerLifecycleMixin, SchedulerUpdateWeightsMixin, SchedulerLoRAMixin):
    def __init__(self, server_args: ServerArgs, model_runner=None):
        from sglang.srt.model_executor.model_runner import ModelRunner

        self.server_args = server_args
        self.model_runner = model_runner or ModelRunner(server_args)
        sizes = self.model_runner.pool_sizes
        self.pool_sizes = sizes
        self.req_to_token_pool = self.model_runner.req_to_token_pool
        self.token_allocator = PagedTokenAllocator(sizes.max_total_tokens, server_args.page_size)
        self.tree_cache = create_tree_cache(
            server_args, self.model_runner, self.req_to_token_pool, self.token_allocator
        )
        self.tracker = MambaTracker(self.req_to_token_pool, self.tree_cache, server_args.mamba_track_interval)
        self.priority = PriorityRule.of(server_args)
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, server_args.random_seed, self.priority)
        self.max_running_requests = sizes.max_running_requests
        self.context_len = server_args.model_config.context_len
        self.max_req_input_len = min(self.context_len - 1, sizes.max_total_tokens - 1)
        self.enable_overlap = server_args.enable_overlap_schedule
        self.watchdog_timeout = server_args.watchdog_seconds
        self.running_inline: tuple[ScheduleBatch, float] | None = None  # see `launch`
        self.cow_on_scheduler_thread = envs.SGLANG_TEST_COW_ON_SCHEDULER_THREAD.get()
        self.check_integrity_when_idle = envs.SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE.get()
        self.idle_checked = False  # the pools were checked since the last step that did work

        self.waiting_queue: list[Req] = []
        self.running: list[Req] = []
        self.chunked_req: Req | None = None
        self.reqs_by_rid: dict[str, Req] = {}
        self.in_flight: deque[tuple[ScheduleBatch, Future]] = deque()
        self.num_batches = 0
        self.processed_batch_id = 0  # batches are processed in launch order: all up to this one are done
        self.events: list[tuple[str, int]] = []  # ("launch" | "process", batch id), for tests
        self.profiler: SchedulerProfiler | None = None  # /start_profile's, made by the first (`profile`)
        self.record_events = False

        future_size = 8 * self.max_running_requests + 64
        self.worker = ForwardWorker(self.model_runner, future_size)
        self.loop_times = LoopTimes()
        self.inflight = InflightBatches(self.worker.future_size)  # built and not yet processed
        self.penalty_slots = PenaltySlots()  # rows of the model runner's output token counts
        self.counters = {
            "num_requests_total": 0,
            "num_prompt_tokens_total": 0,
            "num_generation_tokens_total": 0,
            "num_cached_tokens_total": 0,
            "num_retractions_total": 0,
            "num_preemptions_total": 0,  # (of the retractions: by --enable-priority-scheduling)
        }
        graphs = getattr(self.model_runner, "graph_runner", None)
        self.batch_stats = BatchStatsLog(
            server_args.decode_log_interval,
            self.token_allocator,
            self.req_to_token_pool.mamba_allocator,
            self.tree_cache,
            graph_check=graphs.can_run if graphs is not None and graphs.use_graphs else None,
        )
        self.disaggregation_mode = server_args.disaggregation_mode
        # The decode steady state's caches and logs (`DecodeFastPath`), and its parts by name.
        self.fast_path = DecodeFastPath(
            self.req_to_token_pool, self.context_len, prefill_server=self.disaggregation_mode == "prefill"
        )
        self.decode_set, self.rows_cache = self.fast_path.decode_set, self.fast_path.rows_cache
        self.kv_log = self.fast_path.kv_log  # decode slots not yet in the requests' kv_indices
        self.disagg = None  # the PD queue of this side (prefill or decode), if any
        self.init_lora()
        self.init_io()
        self.finisher = FinishChecker.from_server_args(server_args)
        vocab_size, eos = server_args.model_config.vocab_size, self.finisher.eos_token_ids
        backend, why_none = create_grammar_backend(server_args, self.finisher.tokenizer, vocab_size, eos)
        reasoning = ReasoningTokens.create(server_args, self.finisher.tokenizer, vocab_size, eos)
        self.grammar_queue = GrammarQueue(backend, self.admit_request, self.refuse_request, why_none, reasoning)
        self.weight_update = WeightUpdate(self.model_runner.load_like_current)
        self.weights_groups = WeightsUpdateGroups(self.model_runner.device)
        self.custom_logit_reqs = 0  # requests with a custom logit processor
        self.result_processor = BatchResultProcessor(
            self.tree_cache,
            self.tracker,
            self.finisher,
            output_sink=self.send_to_detokenizer,
            on_release=self.remove_request,
            counters=self.counters,
            stream_interval=server_args.stream_interval,
            fast_path=self.fast_path,
        )
        self.result_processor.release_grammar = self.release_grammar
        self.result_processor.routed_experts = getattr(self.model_runner, "routed_experts", None)
        self.spec = None  # --speculative-algorithm: builds verify batches and commits their results
        if server_args.speculative_algorithm is not None:
            from sglang.srt.speculative.ngram_worker import VerifyCollaborators
            from sglang.srt.speculative.spec_worker import create_spec_worker

            assert not self.enable_overlap, "a verify's result is committed before the next batch is built"
            deps = VerifyCollaborators(
                context_len=self.context_len,
                graph_runner=lambda: getattr(self.model_runner, "graph_runner", None),
                req_to_token_pool=self.req_to_token_pool,
                token_allocator=self.token_allocator,
                tree_cache=self.tree_cache,
                tracker=self.tracker,
                inflight=self.inflight,
                penalty_slots=self.penalty_slots,
                result_processor=self.result_processor,
                decode_set=self.decode_set,
                rows_cache=self.rows_cache,
                kv_log=self.kv_log,
                next_batch_id=self._next_batch_id,
                copy_states=self.worker.copy_states,
                add_generated=self.batch_stats.add_generated,
            )
            self.spec = create_spec_worker(server_args, deps, self.model_runner, self.worker.call)
            self.batch_stats.spec_stats = self.spec.stats
            self.result_processor.process_verify = self.spec.process_batch_result_verify
        if self.disaggregation_mode == "prefill":
            from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue

            self.disagg = PrefillBootstrapQueue(self)
            self.result_processor.prefill_handoff = self.disagg.on_prefill_done
        elif self.disaggregation_mode == "decode":
            from sglang.srt.disaggregation.decode import DecodeTransferQueue

            self.disagg = DecodeTransferQueue(self)

    # ---- batch selection ---------------------------------------------------------------------------

    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        return self.get_new_batch_prefill() or self.get_new_batch_decode()

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        self.lora_collect()
        if not self.waiting_queue and self.chunked_req is None:
            return None
        self._preempt_for_priority()
        num_running = len(self.running) + (self.chunked_req is not None)
        if self.chunked_req is None and (
            num_running >= self.max_running_requests or not self.req_to_token_pool.available_size()
        ):
            return None  # no request could be admitted: skip the pass (every step while the queue waits)
        adder = PrefillAdder(
            self.tree_cache, self.req_to_token_pool, self.token_allocator, self._admission_budget(num_running)
        )
        if self.chunked_req is not None:
            adder.add_chunked_req(self.chunked_req)
        self._get_new_batch_prefill_raw(adder, num_running)
        self.counters["num_cached_tokens_total"] += adder.cached_tokens_admitted
        if not adder.spans:
            return None
        decode = None  # --enable-mixed-chunk: the running requests' decode step rides along
        if self.server_args.enable_mixed_chunk:
            decode = take_decode_rows(self.running, self.fast_path, self.tree_cache, self.token_allocator)
        if self.chunked_req is not None and self.chunked_req.prefill_done:
            self.chunked_req = None
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        for req, _, end in adder.spans:
            if end == len(req.fill_ids) and req not in self.running:
                self.running.append(req)
        reqs = adder.reqs + (decode.reqs if decode is not None else [])
        batch = ScheduleBatch(reqs, ForwardMode.EXTEND, self._next_batch_id())
        batch.cached_tokens = adder.cached_tokens_admitted
        spans = [(p, end) for _, p, end in adder.spans]
        batch.prepare_for_extend(
            spans, self.tracker, self.tree_cache, self.inflight, self.penalty_slots, decode
        )
        if self.cow_on_scheduler_thread:
            run_state_ops_here(batch, self.req_to_token_pool.mamba_pool)
        self.lora_seal(batch)
        self._cache_prefill_snapshots(adder.spans)
        return batch

    def _admission_budget(self, num_running: int) -> AdmissionBudget:
        args = self.server_args
        tokens = args.max_prefill_tokens
        if args.chunked_prefill_enabled:
            tokens = min(tokens, args.chunked_prefill_size)
        page = self.token_allocator.page_size
        # Chunks are multiples of the cache chunk: they keep the snapshot lattice of a prompt's first extend.
        align = args.mamba_cache_chunk_size if args.mamba_strategy.extra_buffer else page
        if args.enable_mixed_chunk:
            tokens = mixed_prefill_tokens(tokens, len(self.running), align)
        return AdmissionBudget(
            tokens=tokens,
            running=self.max_running_requests - num_running,
            align=align,
            chunked_prefill=args.chunked_prefill_enabled,
            decode_page_reserve=len(self.running)
            if page == 1
            else sum(1 for r in self.running if len(r.kv_indices) % page == 0),
            chunk_in_progress=self.chunked_req is not None,
            # (A finished request whose release waits for the batch in flight will make room too.)
            nothing_running=num_running == 0 and not self.result_processor.deferred_releases,
        )

    def _cache_prefill_snapshots(self, spans: list[tuple[Req, int, int]]) -> None:
        """The snapshots an extend writes go to the tree as soon as it is prepared (safe by FIFO: whatever
        reads them runs later on the forward stream), each request continuing with a fresh slot: a
        chunk's, and with an extra buffer the prompt's too, so a request with the same prefix hits while
        this one still decodes. no_buffer caches chunks only (its snapshot is a copy)."""
        extra_buffer = self.server_args.mamba_strategy.extra_buffer
        for req, _, end in spans:
            if extra_buffer or end < len(req.fill_ids):
                self.tree_cache.cache_unfinished_req(req, chunked=end < len(req.fill_ids))

    def _get_new_batch_prefill_raw(self, adder: PrefillAdder, num_running: int) -> None:
        """The waiting-queue pass, inside one slot-allocation group capped at what the pass can admit."""
        pool = self.req_to_token_pool
        admissible = min(pool.available_size(), self.max_running_requests - num_running)
        if admissible <= 0:
            return
        cap = admissible * self.server_args.mamba_strategy.resident_slots_per_req
        admitted: list[Req] = []
        with pool.mamba_allocator.alloc_group(cap):
            for req in self.policy.calc_priority(self.waiting_queue):
                if req.num_inflight > 0:
                    continue  # retracted while a batch with it is in flight: wait for its result
                if not self.lora_admits(req, adder) or not adder.add_one_req(req):
                    break  # (its adapter does not fit: it waits, and nobody behind it passes it, as upstream)
                self.lora_acquire(req, adder)
                admitted.append(req)
        if self.waiting_queue[: len(admitted)] == admitted:
            del self.waiting_queue[: len(admitted)]  # the queue's head (first come, first served)
        else:
            taken = set(admitted)  # by identity: Req keeps object hashing and equality
            self.waiting_queue = [r for r in self.waiting_queue if r not in taken]

    def get_new_batch_decode(self) -> ScheduleBatch | None:
        reqs = self.fast_path.select(self.running)
        if self.spec is not None and reqs:
            self.fast_path.flush()  # the drafts read the requests' outputs
            if (batch := self.spec.get_new_batch_verify(reqs)) is not None:
                return batch
        # One more KV slot each; while the pool (after evicting the tree) cannot give that, retract the
        # newest request.
        allocated = None
        while (
            reqs
            and (allocated := alloc_for_decode(self.tree_cache, self.token_allocator, reqs, self.kv_log))
            is None
        ):
            if self.result_processor.deferred_releases:
                # Finished requests give their pages back once the batch in flight is processed, which
                # a step without a new batch does at once: wait for that rather than retract anyone.
                self._forget_decode_set()
                return None
            self._retract_or_abort(reqs.pop())
        if not reqs:
            self._forget_decode_set()  # let the last decode's requests go
            return None
        batch = ScheduleBatch(reqs, ForwardMode.DECODE, self._next_batch_id())
        batch.prepare_for_decode(
            *allocated, self.tracker, self.tree_cache, self.inflight, self.fast_path, self.penalty_slots
        )
        return batch

    def _forget_decode_set(self) -> None:
        """No decode batch this step: the caches of the last decode set let its requests go (their
        pending KV slots appended)."""
        self.fast_path.clear()

    def _next_batch_id(self) -> int:
        self.num_batches += 1
        return self.num_batches

    # ---- running batches ---------------------------------------------------------------------------

    def launch(self, batch: ScheduleBatch) -> None:
        if self.profiler is not None and self.profiler.active:
            mode = batch.forward_mode  # (a speculative verify decodes)
            self.profiler.before_batch(batch.batch_id, mode.is_decode() or mode.is_target_verify())
        if self.spec is not None:
            self.spec.attach(batch)  # EAGLE / NEXTN: the draft layer runs after every target forward
        item = LaunchedBatch(
            batch.forward_batch,
            future_slots=batch.future_slots,
            pre_forward=pre_forward_ops(batch, self.tree_cache, self.req_to_token_pool.mamba_pool),
            has_placeholders=batch.has_placeholders,
            batch_id=batch.batch_id,
        )
        if self.record_events:
            self.events.append(("launch", batch.batch_id))
        # A forward run on this thread (inline) is watched by `watch_inline_forward` while it runs.
        self.running_inline = (batch, time.monotonic()) if self.worker.inline else None
        try:
            fut = self.worker.launch(item)
        finally:
            self.running_inline = None
        self.in_flight.append((batch, fut))
        self.batch_stats.on_launch(
            batch, len(self.running) + (self.chunked_req is not None), len(self.waiting_queue)
        )

    def process_oldest(self) -> None:
        batch, fut = self.in_flight.popleft()
        times, start = self.loop_times, clock()
        result = wait_forward(batch, fut, self.watchdog_timeout)
        landed = clock()
        processors = batch.forward_batch.custom_logit
        if processors is not None and processors.errors:
            for req in batch.reqs:  # (its finish check ends it)
                req.custom_logit_error = processors.errors.get(req.rid, req.custom_logit_error)
        self.inflight.landed(batch, result.next_token_ids)
        self.result_processor.process_batch_result(batch, result)
        times.wait += landed - start
        times.process += clock() - landed
        self.processed_batch_id = batch.batch_id
        if self.record_events:
            self.events.append(("process", batch.batch_id))

    def step(self) -> bool:
        """One loop iteration: schedule and launch a batch, then process results (under overlap, all
        but the batch just launched). Returns False when there was nothing to do."""
        disagg_did = self.disagg.poll() if self.disagg is not None else False
        times, start = self.loop_times, clock()
        grammars = self.grammar_queue
        compiled = False
        if grammars and self.tp is None:  # (with TP, rank 0's tick decides: `apply_tick`)
            # With nothing else to do, wait a little for a grammar being compiled rather than spin.
            quiet = not (self.running or self.waiting_queue or self.in_flight or self.chunked_req)
            compiled = grammars.poll(GRAMMAR_POLL_S if quiet else 0.0)
        processed = False
        if (grammars.held or self.custom_logit_reqs) and self.enable_overlap and self.in_flight:
            # A grammar's mask needs every token its request sampled, and a custom logit processor may
            # read them (its "__req__"): no batch in flight may hold one.
            processed = True
            while self.in_flight:
                self.process_oldest()
        batch = self.get_next_batch_to_run()
        built = clock()
        times.build += built - start
        if batch is not None:
            self.launch(batch)
            times.launch += clock() - built
            if batch.forward_mode.is_decode() or batch.forward_mode.is_target_verify():
                times.decode_batches += 1
            else:
                times.prefill_batches += 1
        keep = 1 if batch is not None and self.enable_overlap else 0
        processed |= len(self.in_flight) > keep
        while len(self.in_flight) > keep:
            self.process_oldest()
        if batch is None and not processed and not disagg_did and not compiled and not grammars:
            # Nothing launched and nothing in flight: idle (processing may have made room, so a step
            # that processed results is never idle).
            self.on_idle()
            return False
        self.idle_checked = False
        return True

    def run_until_idle(self, max_steps: int = 1_000_000) -> None:
        for _ in range(max_steps):
            if not self.step():
                return
        raise RuntimeError("The scheduler did not go idle.")


def run_scheduler_process(
    server_args, port_args: PortArgs, pipe_writer, rank: ParallelRank | None = None
) -> None:
    """Entry point of the scheduler process: load the model, report readiness, serve forever. `rank`:
    this process's place in a tensor- or data-parallel layout (`tp_broadcast.ParallelRank`); only TP
    rank 0 binds the sockets, and it is ready once every rank of its group is."""
    from sglang.srt.utils.process import configure_subprocess

    configure_subprocess(server_args, "scheduler" if rank is None else f"scheduler {rank.describe()}")
    try:
        if rank is not None:
            rank.place()
        tp = join_parallel_group(rank, server_args) if rank is not None and rank.tp_size > 1 else None
        sched = Scheduler(server_args)
        sched.init_parallel(tp, rank.dp_rank if rank is not None else None)
        if tp is None or tp.is_first:
            sched.connect(port_args)
    except (ServerArgsError, ParallelGroupError) as e:
        # A flag that cannot work, or ranks that cannot meet: the parent prints this one sentence.
        pipe_writer.send({"status": "error", "message": str(e), "flag_error": True})
        sys.exit(1)
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
            "memory_bytes_by_rank": sched.memory_bytes_by_rank,
        }
    )
    if sched.worker.inline and sched.watchdog_timeout is not None:
        threading.Thread(target=watch_inline_forward, args=(sched,), name="watchdog", daemon=True).start()
    try:
        with host_profile("scheduler"):
            sched.event_loop()
    except (SchedulerWatchdogError, ParallelGroupError) as e:
        exit_now(str(e), prefix="Watchdog: " if isinstance(e, SchedulerWatchdogError) else "")
    except Exception as e:
        # A model collective that failed: a TP rank is gone (named, if the heartbeats say which).
        if sched.tp is not None and (gone := sched.tp.gone_message(e)) is not None:
            exit_now(gone, prefix="")
        raise
    finally:
        sched.shutdown()
