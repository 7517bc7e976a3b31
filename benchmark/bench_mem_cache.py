"""Micro-benchmark of the state-memory layer (CPU):

- a match + insert cycle of the mamba radix tree on a warm tree;
- `MambaPool.copy_from` of 64 slots over all layers (one indexed op per state kind), for the tiny
  preset's shapes and for a 12-layer slice of a Qwen3-Next-80B rank at TP 8;
- slot alloc/free, one at a time, and inside an allocation group;
- eviction of 2 and of 1,000 leaves (and as many checkpoints) from a 5,000-node tree whose 4,000 least
  recent nodes are locked, as running requests' nodes gather at the start of the LRU lists.

    python benchmark/bench_mem_cache.py [--repeat N]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.mamba_strategy import MambaStrategy
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MambaPool

TINY = Mamba2CacheParams(
    shape=Mamba2StateShape(conv=(128, 3), temporal=(4, 16, 16), conv_kernel=4),
    dtype=Mamba2StateDType(torch.float32, torch.float32),
    layers=(0, 1, 2),
)
# Qwen3-Next-80B at TP 8: conv (8192/8, 3) bf16, SSM (32/8 heads, 128, 128) fp32; 12 of its 36 layers.
QWEN80B_TP8_SLICE = Mamba2CacheParams(
    shape=Mamba2StateShape(conv=(1024, 3), temporal=(4, 128, 128), conv_kernel=4),
    dtype=Mamba2StateDType(torch.bfloat16, torch.float32),
    layers=tuple(range(12)),
)


def timed(fn, repeat: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def bench_match_insert(repeat: int) -> float:
    rng = random.Random(0)
    slots = 4096
    strategy = MambaStrategy.resolve("extra_buffer", radix_cache=True, overlap=True, cache_chunk_size=64)
    pool = HybridReqToTokenPool(8, slots, 1024, TINY, strategy)
    kv = PagedTokenAllocator(1 << 20, 1)
    tree = MambaRadixCache(pool, kv, page_size=1)
    prefixes = [[rng.randrange(512) for _ in range(256)] for _ in range(16)]

    def key() -> list[int]:
        return rng.choice(prefixes)[: rng.randrange(64, 257)] + [rng.randrange(512) for _ in range(256)]

    def cycle() -> None:
        k = key()
        m = tree.match_prefix(k)
        n = len(m.device_indices)
        if kv.available_size() < len(k) or pool.mamba_allocator.available_size() < 2:
            tree.evict(num_tokens=len(k), mamba_num=2)
        fresh = kv.alloc_extend(n, len(k), 0)
        slot = pool.mamba_allocator.alloc(1)[0]
        res = tree.insert(k, m.device_indices + fresh, slot, prev_prefix_len=n)
        if res.mamba_exist:
            pool.mamba_allocator.free([slot])

    for _ in range(500):
        cycle()
    return timed(cycle, repeat)


def bench_copy(params: Mamba2CacheParams, repeat: int) -> tuple[float, int]:
    pool = MambaPool(130, params)
    src, dst = list(range(1, 65)), list(range(65, 129))
    return timed(lambda: pool.copy_from(src, dst), repeat), params.mamba_cache_per_req


def bench_alloc(grouped: bool, repeat: int) -> float:
    alloc = MambaSlotAllocator(4096)

    def run() -> None:
        got = []
        if grouped:
            with alloc.alloc_group(256):
                got = [alloc.alloc(1)[0] for _ in range(256)]
        else:
            got = [alloc.alloc(1)[0] for _ in range(256)]
        alloc.free(got)

    return timed(run, repeat) / 256


def bench_evict(leaves: int, kind: str) -> float:
    """One eviction of `leaves` 2-token leaves (`kind` "full": their KV, "mamba": their checkpoints)
    behind 4,000 locked nodes, in a tree of 5,000; medians of 3 fresh trees."""
    times = []
    for _ in range(3):
        strategy = MambaStrategy.resolve("no_buffer", radix_cache=True, overlap=False, cache_chunk_size=2)
        pool = HybridReqToTokenPool(8, 5100, 64, TINY, strategy)
        kv = PagedTokenAllocator(12_000, 1)
        tree = MambaRadixCache(pool, kv, page_size=1)
        for i in range(5000):
            res = tree.insert([100_000 + i, 1], kv.alloc_extend(0, 2, 0), pool.mamba_allocator.alloc(1)[0], 0)
            if i < 4000:
                tree.inc_lock_ref(res.last_node)
        start = time.perf_counter()
        freed = tree.evict_full(2 * leaves) if kind == "full" else tree.evict_mamba(leaves)
        times.append(time.perf_counter() - start)
        assert freed == (2 * leaves if kind == "full" else leaves)
    return sorted(times)[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(2)
    # The tree benchmark runs last: a large tree makes every later allocation pay for Python's cyclic
    # garbage collector scanning it, which would pollute the other numbers.
    for name, params in [("tiny preset", TINY), ("Qwen3-Next-80B TP8, 12 layers", QWEN80B_TP8_SLICE)]:
        t, per_slot = bench_copy(params, max(5, args.repeat // 20))
        gbs = 2 * 64 * per_slot / t / 1e9
        print(
            f"copy_from 64 slots, {name} ({per_slot / 1e6:.2f} MB/slot): {t * 1e3:8.3f} ms  ({gbs:.1f} GB/s moved)"
        )
    for grouped in (False, True):
        label = "inside a group" if grouped else "one at a time "
        print(f"alloc(1) + free, {label}: {bench_alloc(grouped, args.repeat) * 1e9:8.1f} ns per slot")
    print(
        f"match + insert cycle (512-token keys, warm tree): {bench_match_insert(args.repeat) * 1e6:8.1f} us"
    )
    for kind in ("full", "mamba"):
        for leaves in (2, 1000):
            t = bench_evict(leaves, kind)
            print(f"evict_{kind} of {leaves:5d} behind 4,000 locked nodes (5,000 in all): {t * 1e3:8.2f} ms")


if __name__ == "__main__":
    main()
