"""Prefill admission: which waiting requests join the next extend batch, and how much of each.

A request is matched and admitted in one step (so its match, COW source included, cannot be evicted
by a later admission in the same pass), or released at once. Budgets, exact:
- tokens: --max-prefill-tokens per batch, and --chunked-prefill-size (a longer extend is cut into
  chunks; only one request is mid-prefill at a time);
- KV pages for the extend, evicting unlocked tree leaves if needed;
- request rows and --max-running-requests;
- mamba slots: the running slot (the COW destination of a hit already is one) and the resident track
  slots, evicting checkpoints if needed.
A request that does not fit waits in the queue; nothing asserts on a full pool.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Beyond this many waiting requests lpm falls back to arrival order: matching each one every pass would
# cost more than better ordering saves (upstream's cut-off).
LPM_QUEUE_LIMIT = 128


class SchedulePolicy:
    """`--schedule-policy`: the order in which one admission pass considers the waiting requests.
    fcfs: arrival. lpm: longest cached prefix first (ties in arrival order), so requests that share what
    the cache holds run while it still holds it."""

    def __init__(self, policy: str, tree_cache: BasePrefixCache):
        self.policy = policy
        self.tree_cache = tree_cache

    def calc_priority(self, waiting_queue: list[Req]) -> list[Req]:
        if self.policy == "fcfs" or len(waiting_queue) > LPM_QUEUE_LIMIT:
            return waiting_queue
        tree = self.tree_cache
        hit = {id(r): len(tree.match_prefix(r.all_ids[: r.seqlen - 1]).device_indices) for r in waiting_queue}
        return sorted(waiting_queue, key=lambda r: -hit[id(r)])


class PrefillAdder:
    def __init__(self, sched: Scheduler, num_running: int):
        self.sched = sched
        args = sched.server_args
        budget = args.max_prefill_tokens
        if args.chunked_prefill_enabled:
            budget = min(budget, args.chunked_prefill_size)
        self.rem_tokens = budget
        self.num_running = num_running
        self.rem_running = sched.max_running_requests - num_running
        self.spans: list[tuple[Req, int, int]] = []
        self.new_chunked_req: Req | None = None
        # Extends that track start at multiples of the cache chunk, so chunks end on them too.
        self.align = args.mamba_cache_chunk_size if args.enable_mamba_extra_buffer() else args.page_size

    @property
    def reqs(self) -> list[Req]:
        return [r for r, _, _ in self.spans]

    def add_chunked_req(self, req: Req) -> bool:
        """The request that is mid-prefill continues first (its KV is its own up to here); False if
        its next chunk does not fit this pass."""
        p = req.kv_len
        end = self._chunk_end(p, len(req.fill_ids), continuing=True)
        if end is None or not self._reserve_pages(p, end, reserve_decode=False):
            return False
        self._alloc_kv(req, p, end)
        self._take(req, p, end)
        return True

    def add_one_req(self, req: Req) -> bool:
        """Match and try to admit `req`; False if it does not fit (the pass stops there).

        A hit costs room of its own (the checkpoint stays locked while its copy takes a slot), so a
        hit that does not fit while nothing else runs, and so nothing will free room, is given up and
        the request is admitted cold: waiting would never end."""
        sched = self.sched
        if self.rem_running <= 0 or self.rem_tokens <= 0 or sched.req_to_token_pool.available_size() == 0:
            return False
        req.init_next_round_input()
        admitted, hit = self._try_admit(req, use_cache=True)
        if not admitted and hit and self.num_running == 0 and not self.spans:
            admitted, _ = self._try_admit(req, use_cache=False)
        return admitted

    def _try_admit(self, req: Req, use_cache: bool) -> tuple[bool, bool]:
        """(admitted, matched a prefix). The match stays locked while room is made for the rest."""
        tree = self.sched.tree_cache
        indices: list[int] = []
        if use_cache:
            match = tree.match_prefix(self._match_key(req), cow_mamba=tree.supports_mamba(), req=req)
            indices = match.device_indices
        p = len(indices)
        end = self._chunk_end(p, len(req.fill_ids))
        if end is None or not self._reserve(req, p, end):
            tree.release_match(req)
            return False, p > 0
        self._admit(req, indices, end)
        return True, p > 0

    def _admit(self, req: Req, indices: list[int], end: int) -> None:
        sched, p = self.sched, len(indices)
        req.kv_indices = list(indices)
        req.cache_protected_len = p
        if p:
            req.mark_req_to_token_dirty(0)
        if not req.admitted_once:
            req.cached_tokens = p
            req.admitted_once = True
            sched.counters["num_cached_tokens_total"] += p
        self._alloc_kv(req, p, end)
        self._take(req, p, end)

    # ---- helpers -----------------------------------------------------------------------------------

    def _match_key(self, req: Req) -> list[int]:
        # At least one token is recomputed (its logits pick the next token); input logprobs from
        # position s need the logits at s - 1, so the match stops before it.
        n = len(req.fill_ids) - 1
        if req.wants_input_logprobs():
            n = min(n, max(req.logprob_start_len - 1, 0))
        return req.fill_ids[:n]

    def _chunk_end(self, p: int, total: int, continuing: bool = False) -> int | None:
        """End of this extend: all of it if it fits the token budget, else a chunk ending on an aligned
        position (None: nothing fits this pass). One request at a time is mid-prefill."""
        if total - p <= self.rem_tokens:
            return total
        if not self.sched.server_args.chunked_prefill_enabled:
            return total if not self.spans else None  # an oversized prompt still runs, alone
        if not continuing and (self.new_chunked_req is not None or self.sched.chunked_req is not None):
            return None
        end = (p + self.rem_tokens) // self.align * self.align
        return end if end > p else None

    def _reserve_pages(self, p: int, end: int, reserve_decode: bool) -> bool:
        """Free KV pages for the extend (and one decode step of the running requests), evicting
        unlocked tree leaves if needed."""
        sched = self.sched
        kv = sched.token_allocator
        tree = sched.tree_cache
        need = kv.needed_pages(p, end) + (sched.decode_page_reserve() if reserve_decode else 0)
        missing = need - kv.free_pages()
        if missing <= 0:
            return True
        if tree.evictable_size() // kv.page_size < missing:
            return False  # evicting could not make room: keep the cache
        tree.evict(num_tokens=missing * kv.page_size)
        return kv.free_pages() >= need

    def _reserve(self, req: Req, p: int, end: int) -> bool:
        """Make room for `req`: KV pages for the extend, a row and its mamba slots."""
        sched = self.sched
        if not self._reserve_pages(p, end, reserve_decode=True):
            return False
        pool, tree = sched.req_to_token_pool, sched.tree_cache
        if pool.alloc([req]) is None:
            missing = sched.mamba_slots_needed(req) - pool.mamba_allocator.available_size()
            if missing > tree.mamba_evictable_size():
                return False  # evicting could not make room: keep the cache
            if missing > 0:
                tree.evict(mamba_num=missing)
            if pool.alloc([req]) is None:
                return False
        return True

    def _alloc_kv(self, req: Req, p: int, end: int) -> None:
        last = req.kv_indices[p - 1] if p else 0
        slots = self.sched.token_allocator.alloc_extend(p, end, last)
        assert slots is not None, "admission reserved the pages of this extend"
        req.kv_indices += slots

    def _take(self, req: Req, p: int, end: int) -> None:
        self.spans.append((req, p, end))
        self.rem_tokens -= end - p
        if end < len(req.fill_ids):
            self.new_chunked_req = req
        else:
            self.rem_running -= 1
