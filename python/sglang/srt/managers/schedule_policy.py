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
import random
from dataclasses import dataclass

from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.priority_scheduling import PriorityRule
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.common import alloc_for_extend
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

logger = logging.getLogger(__name__)

# Beyond this many waiting requests lpm falls back to arrival order: matching each one every pass would
# cost more than better ordering saves (upstream's cut-off).
LPM_QUEUE_LIMIT = 128


def cacheable_len(req: Req, n: int) -> int:
    """How much of its first `n` tokens `req` may take from the prefix cache: input logprobs from
    position s need the logits at s - 1, so the match stops before it; a request returning hidden
    states computes again every position it has none for."""
    if req.wants_input_logprobs():
        n = min(n, max(req.logprob_start_len - 1, 0))
    if req.return_hidden_states:
        n = min(n, req.hidden_count)
    return n


class SchedulePolicy:
    """`--schedule-policy`: the order in which one admission pass considers the waiting requests.
    fcfs: arrival. lpm: longest cached prefix first (ties in arrival order), so requests that share what
    the cache holds run while it still holds it. Upstream's random (a fresh shuffle each pass) and lof
    (longest output first: the largest max_new_tokens, ties in arrival order) order with no regard to
    waiting time: a request can wait as long as others keep coming ahead of it."""

    def __init__(
        self, policy: str, tree_cache: BasePrefixCache, seed: int | None = None, priority: PriorityRule | None = None
    ):
        self.policy = policy
        self.tree_cache = tree_cache
        self.priority = priority  # --enable-priority-scheduling: by priority first, then by the policy
        # random's shuffles follow --random-seed: a run repeats, and (tensor parallelism) every rank that
        # schedules the same queue orders it alike.
        self.rng = random.Random(seed)

    def calc_priority(self, waiting_queue: list[Req]) -> list[Req]:
        order = self._policy_order(waiting_queue)
        return order if self.priority is None else self.priority.order(order)

    def _policy_order(self, waiting_queue: list[Req]) -> list[Req]:
        if self.policy == "random":
            return self.rng.sample(waiting_queue, len(waiting_queue))
        if self.policy == "lof":
            return sorted(waiting_queue, key=lambda r: -r.sampling_params.max_new_tokens)
        if self.policy == "fcfs" or len(waiting_queue) > LPM_QUEUE_LIMIT:
            return waiting_queue
        tree = self.tree_cache

        def hit(r: Req) -> int:  # (the prefix its admission would match)
            key = r.all_ids[: cacheable_len(r, r.seqlen - 1)]
            return len(tree.match_prefix(key, namespace=r.extra_key).device_indices)

        hits = {id(r): hit(r) for r in waiting_queue}
        return sorted(waiting_queue, key=lambda r: -hits[id(r)])


@dataclass(frozen=True)
class AdmissionBudget:
    """What one admission pass may admit, fixed when the pass starts."""

    tokens: int  # --max-prefill-tokens, capped by --chunked-prefill-size
    running: int  # request slots left under --max-running-requests
    align: int  # chunks are multiples of this (the cache chunk when extends track, else the page)
    chunked_prefill: bool
    decode_page_reserve: int  # pages the running requests' next decode step needs
    chunk_in_progress: bool  # a request is mid-prefill already (only one may be)
    nothing_running: bool  # nothing else runs: waiting cannot make room


class PrefillAdder:
    def __init__(
        self,
        tree_cache: BasePrefixCache,
        req_to_token_pool: HybridReqToTokenPool,
        token_allocator: PagedTokenAllocator,
        budget: AdmissionBudget,
    ):
        self.tree_cache = tree_cache
        self.req_to_token_pool = req_to_token_pool
        self.token_allocator = token_allocator
        self.budget = budget
        self.rem_tokens = budget.tokens
        self.rem_running = budget.running
        self.spans: list[tuple[Req, int, int]] = []
        self.new_chunked_req: Req | None = None
        self.cached_tokens_admitted = 0  # prefix hits of requests admitted for the first time

    @property
    def reqs(self) -> list[Req]:
        return [r for r, _, _ in self.spans]

    def add_chunked_req(self, req: Req) -> bool:
        """The request that is mid-prefill continues first (its KV is its own up to here); False if
        its next chunk does not fit this pass."""
        p = req.kv_len
        end = self._chunk_end(p, len(req.fill_ids), continuing=True)
        if end is None or not alloc_for_extend(
            self.tree_cache, self.req_to_token_pool, self.token_allocator, req, p, end
        ):
            return False
        self._take(req, p, end)
        return True

    def add_one_req(self, req: Req) -> bool:
        """Match and try to admit `req`; False if it does not fit (the pass stops there).

        A hit costs room of its own (the checkpoint stays locked while its copy takes a slot), so a
        hit that does not fit while nothing else runs, and so nothing will free room, is given up and
        the request is admitted cold: waiting would never end."""
        if self.rem_running <= 0 or self.rem_tokens <= 0 or self.req_to_token_pool.available_size() == 0:
            return False
        req.init_next_round_input()
        admitted, hit = self._try_admit(req, use_cache=True)
        if not admitted and hit and self.budget.nothing_running and not self.spans:
            admitted, _ = self._try_admit(req, use_cache=False)
        return admitted

    def _try_admit(self, req: Req, use_cache: bool) -> tuple[bool, bool]:
        """(admitted, matched a prefix). The match stays locked while room is made for the rest."""
        tree = self.tree_cache
        indices: list[int] = []
        if use_cache:
            match = tree.match_prefix(self._match_key(req), cow_mamba=tree.supports_mamba(), req=req)
            indices = match.device_indices
        p = len(indices)
        end = self._chunk_end(p, len(req.fill_ids))
        req.kv_indices = list(indices)
        if end is None or not alloc_for_extend(
            tree,
            self.req_to_token_pool,
            self.token_allocator,
            req,
            p,
            end,
            reserve_pages=self.budget.decode_page_reserve,
        ):
            req.kv_indices = []
            tree.release_match(req)
            return False, p > 0
        req.cache_protected_len = p
        if p:
            req.mark_req_to_token_dirty(0)
        if not req.admitted_once:
            req.cached_tokens = p
            req.admitted_once = True
            self.cached_tokens_admitted += p
        self._take(req, p, end)
        return True, p > 0

    # ---- helpers -----------------------------------------------------------------------------------

    @staticmethod
    def _match_key(req: Req) -> list[int]:
        # At least one token is recomputed (its logits pick the next token).
        return req.fill_ids[: cacheable_len(req, len(req.fill_ids) - 1)]

    def _chunk_end(self, p: int, total: int, continuing: bool = False) -> int | None:
        """End of this extend: all of it if it fits the token budget, else a chunk of a multiple of the
        alignment, so that every chunk of a prompt keeps the lattice of its first extend (None: nothing
        fits this pass). One request at a time is mid-prefill."""
        if total - p <= self.rem_tokens:
            return total
        if not self.budget.chunked_prefill:
            return total if not self.spans else None  # an oversized prompt still runs, alone
        if not continuing and (self.new_chunked_req is not None or self.budget.chunk_in_progress):
            return None
        align = self.budget.align
        end = p + self.rem_tokens // align * align
        return end if end > p else None

    def _take(self, req: Req, p: int, end: int) -> None:
        self.spans.append((req, p, end))
        self.rem_tokens -= end - p
        if end < len(req.fill_ids):
            self.new_chunked_req = req
        else:
            self.rem_running -= 1
