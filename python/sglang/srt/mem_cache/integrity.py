"""One accounting check for both pools (run whenever the scheduler is idle, and after every step of
the property tests):

    free + held by requests + reserved by an open group + held by the tree == total

for KV pages and mamba slots, with no page or slot in two places, plus the request rows and the tree's
own invariants; with a host tier, the same for its KV pages and state slots (free + host tree == total).
Every holder is counted: running slots, track slots, COW destinations of waiting
requests, an open allocation group, tree nodes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


def check_accounting(
    tree: BasePrefixCache,
    req_to_token_pool: HybridReqToTokenPool,
    token_allocator: PagedTokenAllocator,
    reqs: Iterable[Req],
) -> None:
    """The identity by counts alone, O(number of live requests): cheap enough for every idle period in
    production. It catches leaks, not a slot held twice (the full `check_integrity` does)."""
    reqs = list(reqs)
    page = token_allocator.page_size
    req_pages = sum(-(-(len(r.kv_indices) - r.cache_protected_len) // page) for r in reqs)
    kv = (token_allocator.free_pages(), req_pages, tree.total_size() // page)
    assert sum(kv) == token_allocator.num_pages, (
        f"KV pages leaked: free {kv[0]} + requests {kv[1]} + tree {kv[2]} != {token_allocator.num_pages}"
    )
    alloc = req_to_token_pool.mamba_allocator
    held = sum(len(req_to_token_pool.mamba_slots_of(r)) for r in reqs)
    slots = (alloc.free_list_size(), alloc.group_size(), held, tree.mamba_total_size())
    assert sum(slots) == alloc.size, (
        f"Mamba slots leaked: free {slots[0]} + group {slots[1]} + requests {slots[2]} + tree {slots[3]} "
        f"!= {alloc.size}"
    )
    rows = len(req_to_token_pool.free_slots) + sum(1 for r in reqs if r.req_pool_idx)
    assert rows == req_to_token_pool.size, (
        f"Request rows leaked: {rows} of {req_to_token_pool.size} accounted"
    )
    host_counts = getattr(tree, "host_counts", None)
    if host_counts is not None:  # the host tier (hiradix_cache.py): free + held by the host tree == total
        assert host_counts() == (0, 0), f"Host tier leaked (pages, slots off by): {host_counts()}"


def _partition(what: str, total: set[int], holders: dict[str, list[int]]) -> None:
    counts = Counter()
    for slots in holders.values():
        counts.update(slots)
    twice = sorted(s for s, c in counts.items() if c > 1)
    assert not twice, f"{what} held twice: {twice[:10]} ({ {k: len(v) for k, v in holders.items()} })"
    held = set(counts)
    missing, extra = total - held, held - total
    assert not missing, f"{what} leaked (held by nobody): {sorted(missing)[:10]}"
    assert not extra, f"{what} outside the pool: {sorted(extra)[:10]}"


def check_integrity(
    tree: BasePrefixCache,
    req_to_token_pool: HybridReqToTokenPool,
    token_allocator: PagedTokenAllocator,
    reqs: Iterable[Req],
) -> None:
    reqs = list(reqs)
    page = token_allocator.page_size
    req_pages = []
    for r in reqs:
        req_pages += sorted({t // page for t in r.kv_indices[r.cache_protected_len :]})
    _partition(
        "KV page",
        set(range(1, token_allocator.num_pages + 1)),
        {
            "free": list(token_allocator._free_pages),
            "requests": req_pages,
            "tree": sorted({t // page for t in tree.held_kv_slots()}),
        },
    )
    alloc = req_to_token_pool.mamba_allocator
    _partition(
        "mamba slot",
        set(range(1, alloc.size + 1)),
        {
            "free": list(alloc._free),
            "group": list(alloc._group or ()),
            "requests": [s for r in reqs for s in req_to_token_pool.mamba_slots_of(r)],
            "tree": tree.held_mamba_slots(),
        },
    )
    _partition(
        "request row",
        set(range(1, req_to_token_pool.size + 1)),
        {
            "free": list(req_to_token_pool.free_slots),
            "requests": [r.req_pool_idx for r in reqs if r.req_pool_idx],
        },
    )
    sanity = getattr(tree, "sanity_check", None)
    if sanity is None:
        return
    sanity()
    check_host = getattr(tree, "check_host_integrity", None)
    if check_host is not None:
        check_host()
    holders = [r for r in reqs if r.last_node is not None and r.last_node is not tree.root]
    locks = Counter(id(r.last_node) for r in holders)
    pins = Counter(id(r.last_node) for r in holders if tree.pins_checkpoint(r))
    assert set(tree.kv_only_locks) <= {id(r) for r in holders}, "a KV-only lock held by no live request"
    for node in tree.nodes():
        if node is tree.root:
            continue
        assert node.mamba_lock_ref == pins.get(id(node), 0), f"{node}: mamba locks != requests pinning it"
        direct = node.full_lock_ref - sum(c.full_lock_ref for c in node.children.values())
        assert direct == locks.get(id(node), 0), f"{node}: direct locks != requests holding it"
    for r in reqs:
        if r.last_node is None:
            assert r.cache_protected_len == 0, f"{r} protects KV without a tree lock"
            continue
        path = []
        node = r.last_node
        while node is not None:
            path[:0] = node.value
            node = node.parent
        assert r.kv_indices[: r.cache_protected_len] == path, f"{r}: protected KV differs from its tree path"
