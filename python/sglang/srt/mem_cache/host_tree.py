"""`HostRadixTree`: the host tier's radix tree (`HiMambaRadixCache.host_tree`), a `MambaRadixCache` over the
host pools' allocators whose state eviction keeps each path's deepest checkpoint.

A host checkpoint is worth something only as a place a later request resumes from. One with a deeper host
checkpoint below it on its path serves only the requests that leave the path between the two; the deeper
one serves every other. Plain LRU gets this backwards on a cyclic multi-turn workload (each conversation
returns after all the others): write_through backs up every prefill snapshot of the newest conversations,
and the LRU drops the oldest conversations' deepest checkpoints to hold them, so every conversation is
lost by the time it returns. So when state slots are needed the host tree frees, LRU first within each
class, in this order:
  1. interior checkpoints on a single path (one child): the node becomes a tombstone, its KV stays as the
     path of the checkpoints below it;
  2. interior checkpoints where paths branch (two or more children): the only place a request that leaves
     there can resume from, so they go after the chains' interior ones;
  3. leaves, evicted whole with the tombstones above them (as `MambaRadixCache.evict_mamba` does).
The checkpoint a backup extends counts as interior while room is made for it (`make_room`): with every
slot holding a leaf, a conversation's next checkpoint replaces its previous one, not another
conversation's. The classes are an index kept in step with the tree (each checkpoint's class and LRU
stamp, a heap per class: O(log n) an eviction, where a pass over the LRU took ~0.3 ms at 2,048 host
checkpoints, all leaves: `benchmark/bench_host_evict.py`); it changes where the LRU does (an insert,
a refresh, a removal: `_StampedLRU`) and where a checkpoint's children do (`_add_leaf`, `_evict_leaf`,
`make_room`'s extended node), and `sanity_check` checks it against the tree. Each change pushes an entry
numbered by a sequence of its own, the node's latest push the only one valid (a node that returns to a
class it held at the same stamp would otherwise revive its older entries: they piled up without bound
under a checkpoint whose children come and go, and an eviction could take one node twice); the heaps
are compacted once they hold more than twice the checkpoints (+64) entries, so they stay O(checkpoints).
Every leaf holds a checkpoint (the tree's invariant 2: the host tree takes no KV-only locks), so an
interior checkpoint always has a deeper one below it. The order depends on the tree alone: TP ranks, whose
host trees are equal, evict alike. KV eviction (`evict_full`) keeps the tree's own rule: LRU leaves.
"""

from __future__ import annotations

import heapq

from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.common import evict_from_tree_cache
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.mamba_tree import LRUList, TreeNode

CHAIN, FORK, LEAF = 0, 1, 2  # the classes, in eviction order


class _StampedLRU(LRUList):
    """The host tree's checkpoint LRU: each node entering it (an insert, a refresh) gets the next stamp,
    so stamp order is LRU order, and the tree's class index follows every change (`HostRadixTree._index`)."""

    def __init__(self, tree: HostRadixTree):
        super().__init__()
        self.tree = tree
        self.stamp = 0

    def insert_mru(self, node: TreeNode) -> None:
        super().insert_mru(node)
        self.stamp += 1
        self.tree._index(node, self.stamp)

    def remove(self, node: TreeNode) -> None:
        super().remove(node)
        self.tree._unindex(node)

    def insert_before(self, node: TreeNode, ref: TreeNode) -> None:
        raise AssertionError("a checkpoint enters the host LRU at its most recent end (stamp order)")


class HostRadixTree(MambaRadixCache):
    # The node an insert being made room for extends (`make_room`): interior once it is done.
    _extending: TreeNode | None = None

    def reset_tree(self) -> None:
        super().reset_tree()
        # The class index: each checkpoint's (LRU stamp, class: CHAIN / FORK / LEAF, push number), one
        # heap per class of (stamp, push number, node) entries, an entry valid only while it is its node's
        # latest push (the stale ones dropped when met, and all of them once they outnumber the
        # checkpoints twice over: `_compact`), and the pinned checkpoints.
        self._cls: dict[int, tuple[int, int, int]] = {}
        self._heaps: tuple[list, list, list] = ([], [], [])
        self._pushes = 0
        self._pinned: dict[int, TreeNode] = {}
        self.mamba_lru = _StampedLRU(self)

    # ---- the class index (kept in step by the LRU, `_add_leaf`, `_evict_leaf` and `make_room`) ------

    def _class_of(self, node: TreeNode) -> int:
        children = len(node.children) + (node is self._extending)
        return CHAIN if children == 1 else FORK if children else LEAF

    def _index(self, node: TreeNode, stamp: int) -> None:
        cls = self._class_of(node)
        self._pushes += 1
        self._cls[node.id] = (stamp, cls, self._pushes)
        heapq.heappush(self._heaps[cls], (stamp, self._pushes, node))
        self._compact()

    def _unindex(self, node: TreeNode) -> None:
        del self._cls[node.id]
        self._compact()

    def _reclassify(self, node: TreeNode) -> None:
        """After `node`'s children (or `_extending`) changed: its class, if it holds a checkpoint."""
        entry = self._cls.get(node.id)
        if entry is not None and self._class_of(node) != entry[1]:
            self._index(node, entry[0])

    def _valid(self, entry: tuple[int, int, TreeNode]) -> bool:
        indexed = self._cls.get(entry[2].id)
        return indexed is not None and indexed[2] == entry[1]

    def _compact(self) -> None:
        """Every stale entry dropped once the heaps hold more than 2 x checkpoints + 64: each compaction
        drops more entries than it keeps, so its cost is amortized O(1) a push, and a stale entry keeps
        an evicted node alive only until then."""
        if sum(map(len, self._heaps)) > 2 * len(self._cls) + 64:
            for heap in self._heaps:
                heap[:] = [e for e in heap if self._valid(e)]
                heapq.heapify(heap)

    def _pop(self, cls: int, want: int) -> list[TreeNode]:
        """Up to `want` unpinned checkpoints of class `cls`, least recently used first, taken off its
        heap (the pinned ones met are taken off too: every one before the last taken is refreshed)."""
        heap, out = self._heaps[cls], []
        while heap and len(out) < want:
            entry = heapq.heappop(heap)
            if self._valid(entry) and not entry[2].mamba_lock_ref:
                out.append(entry[2])
        return out

    def _add_leaf(self, parent: TreeNode, key, value, mamba_value: int, namespace: str | None) -> TreeNode:
        node = super()._add_leaf(parent, key, value, mamba_value, namespace)
        self._reclassify(parent)
        return node

    def _evict_leaf(self, leaf: TreeNode, evicted: dict | None = None) -> tuple[int, TreeNode]:
        freed, kept = super()._evict_leaf(leaf, evicted)
        self._reclassify(kept)
        return freed, kept

    def inc_lock_ref(self, node: TreeNode, pin_checkpoint: bool = True) -> None:
        super().inc_lock_ref(node, pin_checkpoint)
        if pin_checkpoint and node is not self.root:
            self._pinned[node.id] = node

    def dec_lock_ref(self, node: TreeNode, pin_checkpoint: bool = True) -> None:
        super().dec_lock_ref(node, pin_checkpoint)
        if pin_checkpoint and node is not self.root and not node.mamba_lock_ref:
            del self._pinned[node.id]

    # ---- eviction ----------------------------------------------------------------------------------

    def make_room(
        self, end: TreeNode, extends: bool, kv: PagedTokenAllocator, pages: int, slots: MambaSlotAllocator
    ) -> bool:
        """Room for an insert of `pages` more KV pages and one state below `end`, evicting nothing on
        `end`'s path but maybe `end`'s own checkpoint. With `extends` (the insert adds a node below `end`)
        that checkpoint counts as interior: the insert puts a deeper one below it. Else as
        `evict_from_tree_cache`: True if the room is there."""
        self.hold_path(end, 1)
        self._extending = end if extends else None
        self._reclassify(end)
        try:
            return evict_from_tree_cache(self, kv, pages, slots, 1)
        finally:
            self._extending = None
            self._reclassify(end)
            self.hold_path(end, -1)

    def evict_mamba(self, num: int) -> int:
        """Free `num` unpinned checkpoints, interior ones before leaves (module docstring): the `num`
        least recently used of the first class if it has that many, else all of it and then the next
        classes' in order, from the class index (`_pop`), not a pass over the LRU. Dropping an interior
        checkpoint changes no node's class, and the leaves go only once every interior candidate went
        (an evicted leaf's parent that becomes a leaf is then a tombstone or pinned). Pinned checkpoints
        less recently used than the last one taken move to the most recent end, as a pass over the LRU
        that stopped there (`MambaRadixCache.evict_mamba`) moves those it stepped over."""
        if num <= 0:
            return 0
        chosen = self._pop(CHAIN, num)
        if len(chosen) == num:
            last = self._cls[chosen[-1].id][0]
        else:
            last = None  # (every checkpoint considered)
            chosen += self._pop(FORK, num - len(chosen))
            chosen += self._pop(LEAF, num - len(chosen))
        passed = sorted(
            (self._cls[nid][0], nid, node)
            for nid, node in self._pinned.items()
            if last is None or self._cls[nid][0] < last
        )
        for node in chosen:
            if node.is_leaf and node.full_lock_ref == 0:
                self._evict_leaf(node)
            else:  # an interior node, or a leaf whose path an operation holds: a tombstone now
                self._drop_checkpoint(node)
        for _, _, node in passed:
            self.mamba_lru.touch(node)
        return len(chosen)

    def sanity_check(self) -> None:
        """The tree's invariants, and the class index in step with the LRU, the children and the pins."""
        super().sanity_check()
        stamps = [self._cls[n.id] for n in self.mamba_lru]
        assert len(stamps) == len(self._cls), "the class index holds a node the LRU does not"
        assert all(a[0] < b[0] for a, b in zip(stamps, stamps[1:], strict=False)), "stamps out of LRU order"
        valid = {}  # node id -> (stamp, class, push number) of its valid entries
        for cls, heap in enumerate(self._heaps):
            for stamp, push, node in heap:
                if self._valid((stamp, push, node)):
                    assert node.id not in valid, f"{node} has two valid entries"
                    valid[node.id] = (stamp, cls, push)
        for node, indexed in zip(self.mamba_lru, stamps, strict=True):
            assert indexed[1] == self._class_of(node), f"{node}: class {indexed[1]} in the index"
            assert valid.get(node.id) == indexed, f"{node} has no valid entry in its class's heap"
        assert sum(map(len, self._heaps)) <= 2 * len(self._cls) + 64, "the heaps hold too many stale entries"
        assert self._pinned == {n.id: n for n in self.mamba_lru if n.mamba_lock_ref}, "pinned set"
