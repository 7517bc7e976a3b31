"""`MambaRadixCache`: a radix tree over token ids whose nodes hold KV slots and, optionally, a checkpoint
of the recurrent state after their last token.

A recurrent state is a value at one position: it cannot be split or truncated like per-token KV. So a
match is usable only down to the deepest node with a checkpoint; splitting an edge leaves a tombstone
parent; and states reach the tree by donation: a request hands over a slot that already holds the right
state (a track slot under the extra-buffer strategies; its running slot when it finishes, under every
strategy where that state is settled) and, if it continues, takes a fresh slot in exchange. The only
copies are COW on a hit (tree -> request, deferred to the forward stream) and the `no_buffer` snapshot
of a chunked request (request -> tree), queued in `pending_state_copies` for the forward stream.

Slots and pages are host ints. Allocation never asserts: when a slot cannot be had even after evicting
one checkpoint, the operation degrades (no hit, or no checkpoint) and says so to its caller.
"""

from __future__ import annotations

import heapq
import logging
import operator
from typing import TYPE_CHECKING

from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache, EvictResult, InsertResult, MatchResult
from sglang.srt.mem_cache.common import alloc_mamba_slot
from sglang.srt.mem_cache.mamba_tree import MambaTree, TreeNode
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


class MambaRadixCache(MambaTree, BasePrefixCache):
    def __init__(
        self,
        req_to_token_pool: HybridReqToTokenPool,
        token_allocator: PagedTokenAllocator,
        page_size: int = 1,
    ):
        strategy = req_to_token_pool.strategy
        if not strategy.extra_buffer and page_size != 1:
            raise ValueError("MambaRadixCache without an extra buffer (no_buffer) needs page_size 1.")
        self.req_to_token_pool = req_to_token_pool
        self.token_allocator = token_allocator
        self.mamba_allocator = req_to_token_pool.mamba_allocator
        self.page_size = page_size
        self.cache_chunk_size = strategy.cache_chunk_size
        self.enable_mamba_extra_buffer = strategy.extra_buffer
        # extra_buffer_lazy: a request holds its newest snapshot by a KV-only lock (mamba_tree.py), so
        # the tree may evict that checkpoint while the request runs; its running slot is all it holds.
        self.kv_only_snapshot_locks = strategy.lazy
        # (src, dst) state copies the forward stream must run before any later batch reads dst.
        self.pending_state_copies: list[tuple[int, int]] = []
        self.reset()

    def reset(self) -> None:
        self.reset_tree()
        self.pending_state_copies = []

    # ---- match -------------------------------------------------------------------------------------

    def match_prefix(
        self, key: list[int], cow_mamba: bool = False, req: Req | None = None, namespace: str | None = None
    ) -> MatchResult:
        """`namespace`: where no `req` is given, the prefix-cache namespace to match in (else the
        request's `extra_key`)."""
        key = key[: self._page_aligned(len(key))]
        path, matched = self._walk(key, req.extra_key if req is not None else namespace)
        node = path[-1][0] if path else self.root
        best_node, best_len = self.root, 0
        for child, start in path:
            if child.mamba_value is not None:
                best_node, best_len = child, start + len(child.key)
        if node is not self.root:
            self.full_lru.touch_path(node, self.root)
        if best_node is not self.root:
            # Only the consumed checkpoint is refreshed (upstream #31643): refreshing the whole chain
            # clusters a session's states and evicts cold sessions wholesale.
            self.mamba_lru.touch(best_node)

        if req is not None:
            # The request holds the lock from here: admission may evict to make room, and must not
            # evict what this match hands out. `release_match` unlocks if it is not admitted.
            if cow_mamba and best_node is not self.root and not self._prepare_cow(best_node, req):
                best_node, best_len = self.root, 0
            if best_node is not self.root:
                self.inc_lock_ref(best_node)
                req.last_node = best_node
        branching = None
        if self.enable_mamba_extra_buffer and matched > best_len:
            # On the lattice of the extend that will start at the hit (see mamba_tracking).
            c = self.cache_chunk_size
            b = best_len + (matched - best_len) // c * c
            branching = b if b > best_len else None
        if req is not None:
            req.mamba_branching_seqlen = branching
        indices: list[int] = []
        for child, _ in path:
            if len(indices) >= best_len:
                break
            indices.extend(child.value)
        return MatchResult(indices, best_node, branching, matched)

    def _prepare_cow(self, node: TreeNode, req: Req) -> bool:
        """Give `req` a running slot to copy `node`'s checkpoint into; the copy runs on the forward
        stream. False if no slot can be had (the match then degrades to no hit)."""
        pool = self.req_to_token_pool
        if req.mamba_pool_idx is None:
            self.inc_lock_ref(node)  # the source must survive the evict-and-retry below
            slot = self.alloc_mamba_slot()
            self.dec_lock_ref(node)  # (the caller locks it for the request)
            if slot is None:
                return False
            pool.set_running_slot(req, slot, needs_clear=False)
        req.mamba_cow_src_index = node.mamba_value
        req.mamba_needs_clear = False
        return True

    def release_match(self, req: Req) -> None:
        if req.req_pool_idx is None:
            self.req_to_token_pool.free_running_slot(req)
            self._release_lock(req)
        req.mamba_cow_src_index = None
        req.mamba_needs_clear = False
        req.mamba_branching_seqlen = None

    def alloc_mamba_slot(self) -> int | None:
        """One slot; if the pool is dry, evict one checkpoint and retry once."""
        return alloc_mamba_slot(self, self.mamba_allocator)[0]

    # ---- insert ------------------------------------------------------------------------------------

    def insert(
        self,
        key: list[int],
        value: list[int],
        mamba_value: int,
        prev_prefix_len: int = 0,
        namespace: str | None = None,
    ) -> InsertResult:
        """Insert `key` -> KV `value` with a checkpoint `mamba_value` after its last token. KV that the tree
        already holds at positions >= prev_prefix_len is freed (the caller's duplicates). If the end node
        already has a checkpoint, `mamba_exist` is true and the caller keeps (and must free) its slot."""
        assert len(key) == len(value) and len(key) % self.page_size == 0
        if not key:
            return InsertResult(0, True)
        path, i = self._walk(key, namespace)
        node = path[-1][0] if path else self.root
        duplicates: list[int] = []
        tree_indices: list[int] = []
        for child, start in path:
            lo = max(start, prev_prefix_len)
            end = start + len(child.key)
            if lo < end:
                mine, theirs = value[lo:end], child.value[lo - start :]
                assert not any(map(operator.eq, mine, theirs)), "the caller passed tree-owned KV as its own"
                duplicates += mine
                tree_indices += theirs
        if duplicates:
            self.token_allocator.free(duplicates)
        if i < len(key):
            node = self._add_leaf(node, key[i:], value[i:], mamba_value, namespace)
            self.full_lru.touch_path(node, self.root)
            return InsertResult(i, False, node, tree_indices)
        self.full_lru.touch_path(node, self.root)
        if node.mamba_value is not None:
            self.mamba_lru.touch(node)
            return InsertResult(i, True, node, tree_indices)
        self._set_checkpoint(node, mamba_value)
        return InsertResult(i, False, node, tree_indices)

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: list[int], mamba_value: int, namespace: str | None
    ) -> TreeNode:
        node = TreeNode(key, value, parent, namespace)
        parent.children[self._child_key(node.key, 0, namespace)] = node
        self.full_lru.insert_mru(node)
        self.full_evictable_size_ += len(value)
        self._set_checkpoint(node, mamba_value)
        return node

    def _set_checkpoint(self, node: TreeNode, slot: int) -> None:
        assert node.mamba_value is None and node.mamba_lock_ref == 0
        node.mamba_value = slot
        self.mamba_lru.insert_mru(node)
        self.mamba_evictable_size_ += 1

    # ---- caching requests --------------------------------------------------------------------------

    def _final_state_insertable(self, req: Req) -> bool:
        """The request's running slot can be the checkpoint of its whole KV once no batch in flight
        advances it: it has one, and the KV ends on a page (a checkpoint ends a page-aligned key)."""
        return req.mamba_pool_idx is not None and req.kv_len % self.page_size == 0

    def defers_finished_release(self, req: Req) -> bool:
        return self.enable_mamba_extra_buffer and self._final_state_insertable(req)

    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """With a track buffer (`extra_buffer`), the request's newest track snapshot goes in with its KV up
        to there (the keep entry, donated), as upstream does; under lazy the tree has it already
        (`cache_snapshot`). Then, where the running state is settled (always under `no_buffer`), the whole
        KV goes in with the running slot as the final checkpoint (donated): the next turn of a conversation
        hits all of it, where upstream recomputes the tail since the last track boundary (up to
        `--mamba-track-interval` tokens, the whole answer when it is shorter)."""
        pool = self.req_to_token_pool
        ids, kv_len, ns = req.all_ids, len(req.kv_indices), req.extra_key
        own_from = req.cache_protected_len  # the request's own KV starts here
        keep_idx = None
        track_len = req.mamba_last_track_seqlen if self.enable_mamba_extra_buffer else None
        if is_insert and track_len is not None and own_from < track_len <= kv_len:
            keep_idx = pool.get_mamba_ping_pong_keep_idx(req)
            slot = req.mamba_ping_pong_track_buffer[keep_idx]
            assert slot != -1, f"{req} has no snapshot for position {track_len}"
            if self.insert(ids[:track_len], req.kv_indices[:track_len], slot, own_from, ns).mamba_exist:
                keep_idx = None
            own_from = track_len
        if is_insert and own_from < kv_len and req.num_inflight == 0 and self._final_state_insertable(req):
            res = self.insert(ids[:kv_len], req.kv_indices[:kv_len], req.mamba_pool_idx, own_from, ns)
            if not res.mamba_exist:
                pool.donate_running_slot(req)
            own_from = kv_len
        if kv_len > own_from:
            self.token_allocator.free(req.kv_indices[own_from:kv_len])
        pool.free_mamba_cache(req, keep_idx)
        self._release_lock(req)
        pool.free(req)
        req.kv_indices = []
        req.cache_protected_len = 0

    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Hand a continuing request's new snapshots to the tree: its borrowed extra snapshots, and the
        primary one (extra buffer: the keep entry, exchanged for a fresh slot; no_buffer: a copy of the
        running slot into a fresh slot, queued for the forward stream). The primary is skipped if no
        fresh slot can be had. The request then holds the tree's KV up to the deepest one, locked."""
        pool = self.req_to_token_pool
        donations = [(pos, slot, None) for slot, pos in pool.take_extra_snapshots(req)]
        if self.enable_mamba_extra_buffer:
            primary = req.mamba_last_track_seqlen
        else:
            primary = len(req.kv_indices)
        if primary is not None and primary > req.cache_protected_len:
            new_slot = self.alloc_mamba_slot()
            if new_slot is None:
                logger.debug("No mamba slot for the checkpoint of %s at %d: skipped.", req, primary)
            elif self.enable_mamba_extra_buffer:
                keep_idx = pool.get_mamba_ping_pong_keep_idx(req)
                donations.append((primary, pool.exchange_mamba_ping_pong_slot(req, keep_idx, new_slot), None))
                req.mamba_last_track_seqlen = None
            else:
                donations.append((primary, new_slot, req.mamba_pool_idx))
        for pos, slot, copy_from in sorted(donations, key=lambda d: d[0]):
            self._donate_snapshot(req, pos, slot, copy_from)

    def cache_snapshot(self, req: Req, pos: int, slot: int) -> None:
        """Hand the tree a continuing request's snapshot at `pos` (a decode one under lazy, its result
        processed: the tokens before `pos` are known). The tree owns `slot` from here; the request protects
        its KV up to `pos` through the tree (a snapshot at or before what it protects already is freed)."""
        self._donate_snapshot(req, pos, slot, None)

    def _donate_snapshot(self, req: Req, pos: int, slot: int, copy_from: int | None) -> None:
        """Insert the request's prefix up to `pos` with the checkpoint `slot` (filled from `copy_from` on
        the forward stream, if given); the request then protects that prefix through the tree. A snapshot
        at or before what the request protects already is freed: moving its lock back to `pos` would
        leave the tree's KV in (pos, protected] counted as the request's own (held twice, and passed to a
        later insert as the caller's), and a lazy tombstone leaf it held would be evicted under it. (A
        borrowed snapshot can trail a deeper one the tree already has: `cache_unfinished_req` hands over
        the borrowed ones after a decode snapshot was committed by `cache_snapshot`.)"""
        protected = req.cache_protected_len
        if pos <= protected:
            assert copy_from is None, f"{req}: a copied snapshot at {pos} behind {protected}"
            self.mamba_allocator.free([slot])
            return
        res = self.insert(req.all_ids[:pos], req.kv_indices[:pos], slot, protected, req.extra_key)
        if res.mamba_exist:
            self.mamba_allocator.free([slot])
        elif copy_from is not None:
            self.pending_state_copies.append((copy_from, slot))
        node = res.last_node
        assert node is not None and node.mamba_value is not None
        if res.tree_indices:
            # The tree's KV replaces the duplicates the insert freed (the rest of the key is now the
            # request's own KV in the tree).
            req.kv_indices[protected : protected + len(res.tree_indices)] = res.tree_indices
            req.mark_req_to_token_dirty(protected)
        self._release_lock(req)
        pin = not self.kv_only_snapshot_locks
        self.inc_lock_ref(node, pin_checkpoint=pin)
        if not pin:
            self.kv_only_locks[id(req)] = node
        req.last_node = node
        req.cache_protected_len = pos

    def take_pending_state_copies(self) -> list[tuple[int, int]]:
        out, self.pending_state_copies = self.pending_state_copies, []
        return out

    def pins_checkpoint(self, req: Req) -> bool:
        """Whether `req`'s lock holds its node's checkpoint too (else it holds the KV only)."""
        return id(req) not in self.kv_only_locks

    def _release_lock(self, req: Req) -> None:
        node = req.last_node
        if node is None:
            return
        kv_only = self.kv_only_locks.pop(id(req), None) is not None
        self.dec_lock_ref(node, pin_checkpoint=not kv_only)
        req.last_node = None
        if kv_only and node.mamba_value is None and node.is_leaf and node.full_lock_ref == 0:
            self._evict_leaf(node)  # a tombstone leaf (its checkpoint evicted) that nobody holds now

    # ---- eviction ----------------------------------------------------------------------------------

    def evict(self, num_tokens: int = 0, mamba_num: int = 0) -> EvictResult:
        return EvictResult(self.evict_full(num_tokens), self.evict_mamba(mamba_num))

    def evict_full(self, num_tokens: int) -> int:
        """Evict unlocked leaves in LRU order (with their checkpoints, then tombstone parents that become
        leaves) until `num_tokens` KV slots are free or nothing is evictable."""
        if num_tokens <= 0:
            return 0
        # A scan from the list's start per leaf stops at the first evictable one: cheap while those
        # sit near the start, but each scan walks every locked and inner node before them again. Once
        # the scans have walked more nodes than the list holds, one ranking pass and a heap take over.
        freed, walked, size = 0, 0, len(self.full_lru)
        while freed < num_tokens and walked <= size:
            leaf, steps = None, 0
            for steps, node in enumerate(self.full_lru, 1):  # noqa: B007 - read after the loop
                if not node.children and node.full_lock_ref == 0:  # (the root is not in the list)
                    leaf = node
                    break
            if leaf is None:
                return freed
            walked += steps
            freed += self._evict_leaf(leaf)[0]
        if freed >= num_tokens:
            return freed
        # Locks do not change here and nodes only leave the list, so the heap's order (by rank in the
        # list) is the scan's; a parent becomes evictable when its last child goes, and joins the heap
        # at its rank.
        rank, ready = {}, []
        for i, node in enumerate(self.full_lru):
            rank[node.id] = i
            if not node.children and node.full_lock_ref == 0:
                ready.append((i, node.id, node))
        heapq.heapify(ready)
        while freed < num_tokens and ready:
            _, _, leaf = heapq.heappop(ready)
            if leaf.id not in rank:
                continue  # evicted with a leaf below it
            n, parent = self._evict_leaf(leaf, evicted=rank)
            freed += n
            if self._full_evictable(parent):
                heapq.heappush(ready, (rank[parent.id], parent.id, parent))
        return freed

    def _full_evictable(self, node: TreeNode) -> bool:
        return node.is_leaf and node.full_lock_ref == 0 and node is not self.root

    def evict_mamba(self, num: int) -> int:
        """Free `num` unpinned checkpoints in LRU order: an inner node becomes a tombstone (its KV stays
        usable as a path), a leaf is evicted whole (or becomes a tombstone while a KV-only lock holds
        it)."""
        freed = 0
        # One pass over the LRU for the whole call, not one from its start per checkpoint (the locked
        # nodes of running requests gather there): freeing a checkpoint changes no other node's lock
        # or place in this list, and evicting a leaf removes from it only that node (`_evict_leaf`
        # stops at the first parent with a checkpoint), which the iteration survives; so the order is
        # the same as a new scan's each time. The locked checkpoints the pass steps over are in use:
        # they move to the most recent end afterwards, so the next call does not step over them again.
        passed: list[TreeNode] = []
        lru = iter(self.mamba_lru)
        while freed < num:
            node = next(lru, None)
            if node is None:
                break
            if node.mamba_lock_ref:
                passed.append(node)
                continue
            if node.is_leaf and node.full_lock_ref == 0:
                self._evict_leaf(node)
            else:  # an inner node, or a leaf that a request holds by a KV-only lock: a tombstone now
                self._drop_checkpoint(node)
            freed += 1
        for node in passed:
            self.mamba_lru.touch(node)
        return freed

    def _drop_checkpoint(self, node: TreeNode) -> None:
        assert node.mamba_lock_ref == 0
        self.mamba_allocator.free([node.mamba_value])
        node.mamba_value = None
        self.mamba_lru.remove(node)
        self.mamba_evictable_size_ -= 1

    def _evict_leaf(self, leaf: TreeNode, evicted: dict | None = None) -> tuple[int, TreeNode]:
        """Evict `leaf` and the tombstone parents that become leaves (their ids leave `evicted`);
        returns the KV slots freed and the first node kept above them."""
        freed = 0
        node = leaf
        while node is not self.root and node.is_leaf and node.full_lock_ref == 0:
            if node is not leaf and node.mamba_value is not None:
                break  # a parent with a checkpoint is a legitimate leaf now
            parent = node.parent
            if node.mamba_value is not None:
                self._drop_checkpoint(node)
            self.token_allocator.free(node.value)
            freed += len(node.value)
            self.full_evictable_size_ -= len(node.value)
            self.full_lru.remove(node)
            del parent.children[self._child_key(node.key, 0, node.namespace)]
            if evicted is not None:
                del evicted[node.id]
            node = parent
        return freed, node
