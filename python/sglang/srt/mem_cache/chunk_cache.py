"""`ChunkCache`: the prefix cache when `--disable-radix-cache` is set. Nothing is shared: a finished
request frees everything it holds, an unfinished one keeps its KV and state."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, EvictResult, MatchResult
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


class ChunkCache(BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: HybridReqToTokenPool,
        token_allocator: PagedTokenAllocator,
        page_size: int = 1,
    ):
        self.req_to_token_pool = req_to_token_pool
        self.token_allocator = token_allocator
        self.page_size = page_size
        self.root = None

    def supports_mamba(self) -> bool:
        return False

    def match_prefix(
        self, key: list[int], cow_mamba: bool = False, req: Req | None = None, namespace: str | None = None
    ) -> MatchResult:
        return MatchResult([], None)

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        if req.kv_indices:
            self.token_allocator.free(req.kv_indices)
        req.kv_indices = []
        self.req_to_token_pool.free_mamba_cache(req)
        self.req_to_token_pool.free(req)

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        return None

    def release_match(self, req: Req) -> None:
        req.mamba_cow_src_index = None
        req.mamba_branching_seqlen = None

    def evict(self, num_tokens: int = 0, mamba_num: int = 0) -> EvictResult:
        return EvictResult()

    def inc_lock_ref(self, node) -> None:
        return None

    def dec_lock_ref(self, node) -> None:
        return None

    def reset(self) -> None:
        return None

    def take_pending_state_copies(self) -> list[tuple[int, int]]:
        return []
