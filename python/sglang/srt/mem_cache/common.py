"""Releasing what a request holds."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


def release_kv_cache(req: Req, tree_cache: BasePrefixCache, is_insert: bool = True) -> None:
    """Give back everything `req` holds: KV pages, mamba slots, its request row and its tree lock.
    With `is_insert` the tree keeps what it can reuse (a finished request's prefix and checkpoint);
    without (abort, or a lazy snapshot that may be unsafe) everything is freed.

    A request that never got a row holds at most what a match gave it (a lock and a COW destination
    slot), which `release_match` gives back."""
    if req.req_pool_idx is None and not req.kv_indices:
        tree_cache.release_match(req)
        return
    tree_cache.cache_finished_req(req, is_insert=is_insert)
