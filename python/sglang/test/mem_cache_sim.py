"""A small, model-free harness that drives requests through the pools and the radix cache.

Synthetic states carry a tag of the prefix they belong to: a slot holding "the state after tokens
ids[:n]" is filled with `tag(ids[:n])` on every layer, and a KV slot of position i holds
`tag(ids[:i + 1])`. A match or COW source that carries the wrong tag is a wrong checkpoint.
The harness plays the forward stream's part too: it runs deferred clears and copies, and writes tags
where a forward would write states.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.integrity import check_integrity
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.mamba_strategy import MambaStrategy
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

SYNTHETIC_PARAMS = Mamba2CacheParams(
    shape=Mamba2StateShape(conv=(3, 3), temporal=(2, 2, 2), conv_kernel=4),
    dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32),
    layers=(0, 1),
)


def tag(prefix: Sequence[int]) -> float:
    """A float identifying a token prefix (exact in float32: below 2**24)."""
    return float(zlib.crc32(bytes(str(list(prefix)), "ascii")) % (1 << 23) + 1)


class MemCacheSim:
    def __init__(
        self,
        *,
        page_size: int = 1,
        kv_tokens: int = 512,
        mamba_slots: int = 32,
        rows: int = 16,
        extra_buffer: bool = True,
        lazy: bool = False,
        overlap: bool = True,
        chunk: int = 4,
        max_context_len: int = 1024,
    ):
        name = "extra_buffer_lazy" if lazy else "extra_buffer" if extra_buffer else "no_buffer"
        strategy = MambaStrategy.resolve(name, radix_cache=True, overlap=overlap, cache_chunk_size=chunk)
        self.pool = HybridReqToTokenPool(rows, mamba_slots, max_context_len, SYNTHETIC_PARAMS, strategy)
        self.kv = PagedTokenAllocator(kv_tokens, page_size)
        self.tree = MambaRadixCache(self.pool, self.kv, page_size)
        self.kv_tags = torch.zeros(self.kv.size + page_size * 2)
        self.reqs: list[Req] = []
        self._n = 0

    # ---- state tags --------------------------------------------------------------------------------

    @property
    def mp(self):
        return self.pool.mamba_pool

    def write_state(self, slot: int, prefix: Sequence[int]) -> None:
        self.mp.conv_state[:, slot] = tag(prefix)
        self.mp.ssm_state[:, slot] = tag(prefix)

    def state_tag(self, slot: int) -> float:
        conv, ssm = self.mp.conv_state[:, slot], self.mp.ssm_state[:, slot]
        values = torch.cat([conv.flatten(), ssm.flatten()]).unique()
        assert values.numel() == 1, f"slot {slot} holds a mixed state"
        return float(values[0])

    # ---- request life ------------------------------------------------------------------------------

    def new_req(self, ids: Sequence[int]) -> Req:
        self._n += 1
        return Req(f"r{self._n}", list(ids))

    def match(self, req: Req, cow: bool = True):
        key = req.all_ids[: max(0, req.seqlen - 1)]
        return self.tree.match_prefix(key, cow_mamba=cow, req=req)

    def admit(self, req: Req, cow: bool = True) -> bool:
        """Match and admit in one step, as the scheduler does (the match locks its node for the
        request); False (and nothing held) if no room."""
        m = self.match(req, cow)
        if self.pool.alloc([req]) is None:
            self.tree.release_match(req)
            return False
        req.kv_indices = list(m.device_indices)
        req.cache_protected_len = len(m.device_indices)
        assert req.last_node is (None if m.last_device_node is self.tree.root else m.last_device_node)
        self.reqs.append(req)
        self.run_deferred([req])
        return True

    def run_deferred(self, reqs: Sequence[Req]) -> None:
        """What the forward stream does before an extend: clear fresh slots, run queued snapshot
        copies, then COW copies."""
        clear = [r.mamba_pool_idx for r in reqs if r.mamba_needs_clear]
        self.mp.clear_slots(clear)
        copies = self.tree.take_pending_state_copies()
        copies += [
            (r.mamba_cow_src_index, r.mamba_pool_idx) for r in reqs if r.mamba_cow_src_index is not None
        ]
        for src, dst in copies:
            self.mp.copy_from([src], [dst])
        for r in reqs:
            r.mamba_needs_clear = False
            r.mamba_cow_src_index = None

    def extend(self, req: Req, n: int, track_at: int | None = None) -> bool:
        """Run n more positions of `req` (KV allocation + the state the forward writes). With
        `track_at`, snapshot the state after that many tokens into the next track entry."""
        start = len(req.kv_indices)
        end = min(start + n, req.seqlen)
        last = req.kv_indices[-1] if req.kv_indices else 0
        slots = self.kv.alloc_extend(start, end, last)
        if slots is None:
            self.tree.evict_full(self.kv.needed_pages(start, end) * self.kv.page_size)
            slots = self.kv.alloc_extend(start, end, last)
            if slots is None:
                return False
        ids = req.all_ids
        for i, s in enumerate(slots):
            self.kv_tags[s] = tag(ids[: start + i + 1])
        req.kv_indices += slots
        self.write_state(req.mamba_pool_idx, ids[:end])
        if track_at is not None and self.pool.strategy.extra_buffer:
            self.track(req, track_at)
        return True

    def track(self, req: Req, seqlen: int, commit: bool = False) -> bool:
        """Snapshot the state after `seqlen` tokens: into the next track entry, or under lazy into a
        borrowed slot (False: none could be had, the snapshot is skipped), which `commit` hands to the
        tree at once, as a processed decode step does (else `cache_unfinished` or `finish` does)."""
        if not self.pool.strategy.lazy:
            buf = req.mamba_ping_pong_track_buffer
            self.write_state(buf[req.mamba_next_track_idx], req.all_ids[:seqlen])
            req.mamba_last_track_seqlen = seqlen
            self.pool.advance_track_entry(req, req.mamba_next_track_idx)
            return True
        slot = self.tree.alloc_mamba_slot()
        if slot is None:
            return False
        self.write_state(slot, req.all_ids[:seqlen])
        self.pool.add_extra_snapshot(req, slot, seqlen)
        if commit:
            self.tree.cache_snapshot(req, seqlen, self.pool.pop_extra_snapshot(req, seqlen))
        return True

    def finish(self, req: Req, is_insert: bool = True) -> None:
        self.tree.cache_finished_req(req, is_insert)
        self.reqs.remove(req)
        self.run_deferred([])

    def cache_unfinished(self, req: Req) -> None:
        self.tree.cache_unfinished_req(req, chunked=True)
        self.run_deferred([])

    def check(self) -> None:
        check_integrity(self.tree, self.pool, self.kv, self.reqs)
        for r in self.reqs:
            ids = r.all_ids
            for i, s in enumerate(r.kv_indices):
                assert self.kv_tags[s] == tag(ids[: i + 1]), f"{r}: KV of position {i} is wrong"

    def assert_match_tags(self, key: Sequence[int], indices: Sequence[int], node) -> None:
        for i, s in enumerate(indices):
            assert self.kv_tags[s] == tag(key[: i + 1]), f"matched KV of position {i} is wrong"
        if node is not self.tree.root:
            assert self.state_tag(node.mamba_value) == tag(key[: len(indices)]), "wrong checkpoint"
