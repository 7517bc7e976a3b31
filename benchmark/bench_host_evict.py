"""Micro-benchmark of the host tier's state eviction (`HostRadixTree.evict_mamba`, mem_cache/host_tree.py):
one checkpoint freed from a host tree of N checkpoints that are all leaves (one conversation each: no
interior checkpoint to take first, the case where the pass over the LRU walked it whole), then one
inserted again, N kept. Times the class index (what the tree runs) and, in the same run, the pass over
the LRU it replaced (the reference of test_host_tree.py's equivalence test), on the same tree.

    python benchmark/bench_host_evict.py [--checkpoints 2048] [--repeat 500]
"""

from __future__ import annotations

import argparse
import time
from types import SimpleNamespace

from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.host_tree import HostRadixTree


def lru_pass(tree: HostRadixTree, num: int) -> int:
    """The pass over the LRU (the eviction before the class index), for comparison."""
    if num <= 0:
        return 0
    chains, forks, leaves, passed = [], [], [], []
    for node in tree.mamba_lru:
        if node.mamba_lock_ref:
            passed.append(node)
            continue
        children = len(node.children) + (node is tree._extending)
        (chains if children == 1 else forks if children else leaves).append(node)
        if len(chains) >= num:
            break
    chosen = (chains + forks + leaves)[:num]
    for node in chosen:
        if node.is_leaf and node.full_lock_ref == 0:
            tree._evict_leaf(node)
        else:
            tree._drop_checkpoint(node)
    for node in passed:
        tree.mamba_lru.touch(node)
    return len(chosen)


def run(checkpoints: int, repeat: int, evict) -> tuple[float, float]:
    """Mean seconds of one `evict(tree, 1)` and of the insert after it over `repeat` rounds on a tree
    of `checkpoints` leaves (the insert: what the index adds to every change of the tree)."""
    slots = MambaSlotAllocator(checkpoints + 1)
    kv = PagedTokenAllocator(4 * (checkpoints + repeat + 2), 1)
    owner = SimpleNamespace(
        strategy=SimpleNamespace(extra_buffer=True, cache_chunk_size=2, lazy=False), mamba_allocator=slots
    )
    tree = HostRadixTree(owner, kv, 1)

    def add(i: int) -> None:
        tree.insert([i, 1], kv.alloc_extend(0, 2, 0), slots.alloc(1)[0], 0)

    for i in range(checkpoints):
        add(i)
    total, inserts = 0.0, 0.0
    for r in range(repeat):
        start = time.perf_counter()
        assert evict(tree, 1) == 1
        mid = time.perf_counter()
        add(checkpoints + r)
        total, inserts = total + mid - start, inserts + time.perf_counter() - mid
    tree.sanity_check()
    return total / repeat, inserts / repeat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--checkpoints", type=int, default=2048)
    parser.add_argument("--repeat", type=int, default=500)
    args = parser.parse_args()
    index, insert = run(args.checkpoints, args.repeat, HostRadixTree.evict_mamba)
    scan, _ = run(args.checkpoints, args.repeat, lru_pass)
    print(
        f"evict_mamba(1), {args.checkpoints} host checkpoints, all leaves: class index {index * 1e6:.1f} us, "
        f"LRU pass {scan * 1e6:.1f} us ({scan / index:.0f}x); an insert {insert * 1e6:.1f} us"
    )

if __name__ == "__main__":
    main()
