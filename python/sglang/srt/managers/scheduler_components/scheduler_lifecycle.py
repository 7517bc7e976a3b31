"""`SchedulerLifecycleMixin`: the `Scheduler` methods that end a request's stay or check the pools:
retraction (one request, or all of them for /pause_generation), removal, the idle check, the integrity
check, /flush_cache's tree reset and shutdown. A mixin, as upstream's scheduler mixins: its methods run on
the scheduler and read its state (this module imports nothing of `scheduler.py`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang.srt.constrained.measured import is_measured
from sglang.srt.managers.schedule_policy import cacheable_len
from sglang.srt.managers.scheduler_components.priority_scheduling import preemption_victims
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.mem_cache.integrity import check_accounting, check_integrity

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger("sglang.srt.managers.scheduler")  # the scheduler's log, as its other parts


class SchedulerLifecycleMixin:
    # ---- retraction --------------------------------------------------------------------------------

    def _retract_or_abort(self, victim: Req) -> None:
        if len(self.running) == 1 and self.chunked_req is None:
            # Alone and still out of pages: prefilling it again would not fit either.
            message = (
                f"The request needs more than the {self.token_allocator.size} tokens the KV cache holds."
            )
            self.abort_with_status([victim], message)
        else:
            self.retract(victim)

    def retract(self, req: Req, why: str = "the KV pool is full") -> None:
        """Give back everything `req` holds and queue it again; it prefills its tokens anew later."""
        logger.info("Retracting %s: %s.", req, why)
        # Its tokens and slots so far go to its lists, nothing later; and it may be back at the same place
        # before the next decode build (a pause that retracts everyone, then its new prefill): the same
        # running list would not show it.
        self.fast_path.clear()
        release_kv_cache(req, self.tree_cache, is_insert=False)
        self.running.remove(req)
        req.reset_for_retract()
        self.waiting_queue.insert(0, req)
        self.counters["num_retractions_total"] += 1

    def _preempt_for_priority(self) -> None:
        """--enable-priority-scheduling: while the most preferred waiting request finds no room, retract
        the running requests it outranks, least preferred first (`priority_scheduling.py`); none where
        retracting all of them would not make its room, and none while a finished request's room comes
        back with the batch in flight (as the decode path waits for it rather than retract)."""
        if self.priority is None or self.result_processor.deferred_releases:
            return
        best, victims = preemption_victims(self.priority, self.waiting_queue, self.running, self._lacks_room)
        if best is None or self._kv_shortfall(best) > sum(len(v.kv_indices) for v in victims):
            return
        if not self.lora_fits_running(best):
            return  # its LoRA adapter would not fit the batch: room made for it would not admit it
        for victim in victims:
            if not self._lacks_room(best):
                break
            self.retract(victim, f"request {best.rid} of priority {best.priority} needs its room")
            self.counters["num_preemptions_total"] += 1

    def _lacks_room(self, req: Req) -> bool:
        """Whether `req` could not be admitted now for want of a request slot (--max-running-requests,
        the pools' rows), of the state slots it holds while running, or of KV (`_kv_shortfall`)."""
        if len(self.running) + (self.chunked_req is not None) >= self.max_running_requests:
            return True
        pool, tree = self.req_to_token_pool, self.tree_cache
        if not pool.available_size():
            return True
        slots = self.server_args.mamba_strategy.resident_slots_per_req
        if pool.mamba_allocator.available_size() + tree.mamba_evictable_size() < slots:
            return True
        return self._kv_shortfall(req) > 0

    def _kv_shortfall(self, req: Req) -> int:
        """The KV slots `req`'s first chunk lacks: its positions past the prefix the radix cache holds for
        it (which it would share, not allocate), less what is free or evictable."""
        total = len(req.origin_input_ids) + len(req.output_ids)
        key = req.all_ids[: cacheable_len(req, total - 1)]
        need = total - len(self.tree_cache.match_prefix(key, namespace=req.extra_key).device_indices)
        if self.server_args.chunked_prefill_enabled:
            need = min(need, self.server_args.chunked_prefill_size)
        return need - self.token_allocator.available_size() - self.tree_cache.evictable_size()

    def retract_all(self) -> None:
        """Finish the batches in flight, then send every running request back to the waiting queue
        (/pause_generation with mode "retract"): their KV and state slots are free afterwards. PD
        requests between their two servers (waiting for or in a transfer) keep theirs."""
        while self.in_flight:
            self.process_oldest()
        if self.chunked_req is not None:
            # Between two prefill chunks a request holds KV and slots as a running one does.
            self.running.append(self.chunked_req)
            self.chunked_req = None
        # retract() queues at the front, so going backwards keeps the running order.
        for req in reversed(list(self.running)):
            self.retract(req)

    # ---- lifecycle ---------------------------------------------------------------------------------

    def release_grammar(self, req: Req) -> None:
        """`req` runs on without its grammar (a reasoning grammar with nothing after its thinking): its
        decode rows, quick check and output check budget are those of a request without one."""
        self.grammar_queue.discard(req)
        self.rows_cache.clear()
        self.finisher.set_quick_check(req)
        if not is_measured(req):
            self.finisher.budget.forget(req)

    def remove_request(self, req: Req) -> None:
        if req.bootstrap is not None and self.disagg is not None:
            self.disagg.on_released(req)
        if req in self.running:
            self.running.remove(req)
        if self.chunked_req is req:
            self.chunked_req = None
        if req in self.waiting_queue:
            self.waiting_queue.remove(req)
        self.grammar_queue.discard(req)
        if req.custom_logit_processor is not None:
            self.custom_logit_reqs -= 1
            req.custom_logit_processor = None
        self.reqs_by_rid.pop(req.rid, None)
        if self.spec is not None:
            self.spec.forget(req)
        if req.penalty_slot is not None:
            # Batches in flight may still count into it: its next owner's first batch zeroes it after them.
            self.penalty_slots.free(req.penalty_slot)
            req.penalty_slot = None

    def live_requests(self) -> list[Req]:
        """Every request that holds KV or slots: those the scheduler knows, and finished ones whose release
        waits for a batch in flight."""
        return list(self.reqs_by_rid.values()) + self.result_processor.deferred_releases

    def on_idle(self) -> None:
        """Check the pools once per idle period (nothing changes while idle): by counts in production,
        the full walk with SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE (on in the test suite)."""
        if self.profiler is not None and self.profiler.active:
            self.profiler.on_idle()  # (a profile whose batches have all run is written now)
        if self.idle_checked:
            return
        self.idle_checked = True
        self.batch_stats.reset()
        self.check_pools()
        if self.tp is not None and self.check_integrity_when_idle:
            self.tp.agree(self.rank_digest(), "scheduler states")  # (the ranks decide alike: tp_broadcast)

    def check_pools(self) -> None:
        """The check of an idle scheduler: the full walk under SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE,
        else the count identity (the walk costs ~0.25 s with default pools)."""
        if self.check_integrity_when_idle:
            self.check_integrity()
        else:
            check_accounting(
                self.tree_cache, self.req_to_token_pool, self.token_allocator, self.live_requests()
            )

    def check_integrity(self) -> None:
        assert not self.in_flight, "check_integrity needs the forward stream drained"
        assert not self.inflight, "every batch built was launched and processed"
        self.fast_path.check(self.running)
        self.fast_path.flush()  # the walk reads every request's lists
        self.penalty_slots.check(self.live_requests())
        self.grammar_queue.check(self.live_requests())
        with_processor = sum(r.custom_logit_processor is not None for r in self.reqs_by_rid.values())
        assert self.custom_logit_reqs == with_processor, (self.custom_logit_reqs, with_processor)
        check_integrity(self.tree_cache, self.req_to_token_pool, self.token_allocator, self.live_requests())

    def is_idle(self) -> bool:
        return (
            not self.in_flight
            and not self.running
            and not self.waiting_queue
            and not self.grammar_queue
            and self.chunked_req is None
            and not (self.disagg is not None and self.disagg.busy())
        )

    def flush_cache(self) -> tuple[bool, str]:
        if not self.is_idle():
            return False, "The cache was not flushed: requests are still running or waiting."
        self._empty_tree()
        return True, ""

    def reset_counts(self) -> None:
        """The counts /metrics and /get_server_info read start from zero (after the server's warm-up: no
        other request has run yet, so this is exact): request and token counters, the batches' stats,
        speculative decoding's totals."""
        for key in self.counters:
            self.counters[key] = 0
        self.batch_stats.reset_counts()
        if self.spec is not None:
            for key in self.spec.stats:
                self.spec.stats[key] = 0

    def _empty_tree(self) -> None:
        """Evict every cached prefix (KV and states) and reset the tree; no request may hold any of it."""
        self.tree_cache.evict(
            num_tokens=self.token_allocator.size, mamba_num=self.req_to_token_pool.mamba_allocator.size
        )
        self.tree_cache.reset()
        self.check_pools()

    def shutdown(self) -> None:
        while self.in_flight:
            self.process_oldest()
        self.worker.shutdown()
        if self.grammar_queue.backend is not None:
            self.grammar_queue.backend.shutdown()
        if self.disagg is not None:
            self.disagg.shutdown()
