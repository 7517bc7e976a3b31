"""Taking and giving back what a request holds, in one place (upstream's names).

Allocate, evict, retry lives here and nowhere else: `evict_from_tree_cache` makes room by evicting
unlocked tree entries in LRU order, but only when that can make enough room (a failed attempt keeps
the cache); `alloc_for_extend` and `alloc_for_decode` take everything an extend or a decode step needs,
or nothing; `alloc_mamba_slot` takes one slot, evicting one checkpoint if the pool is dry;
`alloc_for_verify` and `release_verify_tail` take a speculative verify's slots and give back those of
the rejected drafts.
`release_kv_cache` gives everything back.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.decode_kv_log import DecodeKVLog
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool


def evict_from_tree_cache(
    tree_cache: BasePrefixCache,
    token_allocator: PagedTokenAllocator | None = None,
    num_pages: int = 0,
    mamba_allocator: MambaSlotAllocator | None = None,
    num_slots: int = 0,
) -> bool:
    """Make `num_pages` KV pages and `num_slots` mamba slots free. Evicts nothing unless evicting can
    make room for all of it; True if the room is there."""
    missing_pages = num_pages - token_allocator.free_pages() if token_allocator else 0
    missing_slots = num_slots - mamba_allocator.available_size() if mamba_allocator else 0
    if missing_pages <= 0 and missing_slots <= 0:
        return True
    page = token_allocator.page_size if token_allocator else 1
    if (
        missing_pages > tree_cache.evictable_size() // page
        or missing_slots > tree_cache.mamba_evictable_size()
    ):
        return False
    tree_cache.evict(num_tokens=max(missing_pages, 0) * page, mamba_num=max(missing_slots, 0))
    return (token_allocator is None or token_allocator.free_pages() >= num_pages) and (
        mamba_allocator is None or mamba_allocator.available_size() >= num_slots
    )


def alloc_for_extend(
    tree_cache: BasePrefixCache,
    req_to_token_pool: HybridReqToTokenPool,
    token_allocator: PagedTokenAllocator,
    req: Req,
    prefix_len: int,
    end: int,
    reserve_pages: int = 0,
) -> bool:
    """Everything an extend of `req` over positions [prefix_len, end) needs, or nothing: KV pages for
    it (with `reserve_pages` more kept free), its request row and mamba slots. On success the new KV
    slots are appended to `req.kv_indices`, which holds exactly the prefix."""
    assert len(req.kv_indices) == prefix_len
    need = token_allocator.needed_pages(prefix_len, end) + reserve_pages
    if not evict_from_tree_cache(tree_cache, token_allocator, num_pages=need):
        return False
    if req_to_token_pool.alloc([req]) is None:
        slots = req_to_token_pool.mamba_slots_needed(req)
        alloc = req_to_token_pool.mamba_allocator
        if not evict_from_tree_cache(tree_cache, mamba_allocator=alloc, num_slots=slots):
            return False
        if req_to_token_pool.alloc([req]) is None:
            return False
    last = req.kv_indices[-1] if prefix_len else 0
    new = token_allocator.alloc_extend(prefix_len, end, last)
    assert new is not None, "the pages of this extend were made free above"
    req.kv_indices += new
    return True


def alloc_for_decode(
    tree_cache: BasePrefixCache, token_allocator: PagedTokenAllocator, reqs: list[Req], kv_log: DecodeKVLog
) -> tuple[list[int], list[int]] | None:
    """One more KV slot for every request (a fresh page where its last one is full), or nothing (None).
    Returns the new slots in request order (the step's `out_cache_loc`) and each request's KV length
    after it (the step's `seq_lens`). The fresh pages are taken in one allocation, in request order
    (what `alloc_extend` per request gives). This runs for every running request at every decode step:
    with page size 1 the slots go to `kv_log` (appended to the requests' lists at the next boundary
    that reads them, `DecodeFastPath.flush`) and the lengths follow from the previous step's, so a
    steady step touches no request."""
    page = token_allocator.page_size
    if page == 1:  # every request opens a page: its slot is the page
        if not evict_from_tree_cache(tree_cache, token_allocator, num_pages=len(reqs)):
            return None
        slots = token_allocator.alloc_pages(len(reqs))
        assert slots is not None, "the pages of this step were made free above"
        return slots, kv_log.record(reqs, slots)
    kv_log.clear()
    opens_page = [len(r.kv_indices) % page == 0 for r in reqs]
    need = sum(opens_page)
    if not evict_from_tree_cache(tree_cache, token_allocator, num_pages=need):
        return None
    pages = token_allocator.alloc_pages(need)
    assert pages is not None, "the pages of this step were made free above"
    fresh = iter(pages)
    slots, lens = [], []
    for req, opens in zip(reqs, opens_page, strict=True):
        kv = req.kv_indices
        kv.append(next(fresh) * page if opens else kv[-1] + 1)
        slots.append(kv[-1])
        lens.append(len(kv))
    return slots, lens


def alloc_for_verify(
    tree_cache: BasePrefixCache,
    token_allocator: PagedTokenAllocator,
    reqs: list[Req],
    counts: list[int],
    kv_log: DecodeKVLog,
) -> tuple[list[int], list[int]] | None:
    """`counts[i]` more KV slots for request i (a speculative verify of its newest token and drafts), or
    nothing (None). Returns the new slots in request order and each request's KV length before them."""
    kv_log.clear()  # the decode steps' pending slots go to the lists first
    lens = [len(r.kv_indices) for r in reqs]
    need = sum(token_allocator.needed_pages(n, n + c) for n, c in zip(lens, counts, strict=True))
    if not evict_from_tree_cache(tree_cache, token_allocator, num_pages=need):
        return None
    slots: list[int] = []
    for req, n, c in zip(reqs, lens, counts, strict=True):
        kv = req.kv_indices
        new = token_allocator.alloc_extend(n, n + c, kv[-1] if n else 0)
        assert new is not None, "the pages of this verify were made free above"
        kv += new
        slots += new
    return slots, lens


def release_verify_tail(token_allocator: PagedTokenAllocator, req: Req, keep: int) -> None:
    """After a verify, `req` keeps the KV of its first `keep` positions: the pages of the others that
    hold none of those go back (slots past `keep` in its last page are reused by its next step)."""
    kv = req.kv_indices
    if len(kv) <= keep:
        return
    page = token_allocator.page_size
    last_page = kv[keep - 1] // page
    token_allocator.free([s for s in kv[keep:] if s // page != last_page])
    req.kv_indices = kv[:keep]


def alloc_mamba_slot(
    tree_cache: BasePrefixCache, mamba_allocator: MambaSlotAllocator, failing_tries: int = 0
) -> tuple[int | None, int]:
    """(slot or None, tries that failed): take one slot, else evict one checkpoint and try once more.
    `failing_tries` (0-2) makes that many tries fail on purpose: fault injection for tests, which still
    runs the eviction for real."""
    for attempt in range(2):
        if attempt:
            tree_cache.evict(mamba_num=1)
        got = None if attempt < failing_tries else mamba_allocator.alloc(1)
        if got:
            return got[0], attempt
    return None, 2


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
