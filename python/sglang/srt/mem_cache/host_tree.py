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
conversation's. The class of a node is read during one pass over the state LRU per eviction (~0.1 us a
checkpoint: ~0.2 ms at 2,048 host checkpoints, all leaves, on the loaded 2-core VM).
Every leaf holds a checkpoint (the tree's invariant 2: the host tree takes no KV-only locks), so an
interior checkpoint always has a deeper one below it. The order depends on the tree alone: TP ranks, whose
host trees are equal, evict alike. KV eviction (`evict_full`) keeps the tree's own rule: LRU leaves.
"""

from __future__ import annotations

from itertools import chain

from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.common import evict_from_tree_cache
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.mamba_tree import TreeNode


class HostRadixTree(MambaRadixCache):
    # The node an insert being made room for extends (`make_room`): interior once it is done.
    _extending: TreeNode | None = None

    def make_room(
        self, end: TreeNode, extends: bool, kv: PagedTokenAllocator, pages: int, slots: MambaSlotAllocator
    ) -> bool:
        """Room for an insert of `pages` more KV pages and one state below `end`, evicting nothing on
        `end`'s path but maybe `end`'s own checkpoint. With `extends` (the insert adds a node below `end`)
        that checkpoint counts as interior: the insert puts a deeper one below it. Else as
        `evict_from_tree_cache`: True if the room is there."""
        self.hold_path(end, 1)
        self._extending = end if extends else None
        try:
            return evict_from_tree_cache(self, kv, pages, slots, 1)
        finally:
            self._extending = None
            self.hold_path(end, -1)

    def evict_mamba(self, num: int) -> int:
        """Free `num` unpinned checkpoints, interior ones before leaves (module docstring). One pass over the
        LRU, stopped early once it found `num` of the first class: dropping an interior checkpoint changes
        no node's class, and the leaves go only once every interior candidate went (an evicted leaf's
        parent that becomes a leaf is then a tombstone or pinned). Pinned checkpoints the pass stepped over
        move to the most recent end, as in `MambaRadixCache.evict_mamba`."""
        if num <= 0:
            return 0
        chains: list[TreeNode] = []
        forks: list[TreeNode] = []
        leaves: list[TreeNode] = []
        passed: list[TreeNode] = []
        for node in self.mamba_lru:
            if node.mamba_lock_ref:
                passed.append(node)
                continue
            children = len(node.children) + (node is self._extending)
            (chains if children == 1 else forks if children else leaves).append(node)
            if len(chains) >= num:
                break
        freed = 0
        for node in chain(chains, forks, leaves):
            if freed >= num:
                break
            if node.is_leaf and node.full_lock_ref == 0:
                self._evict_leaf(node)
            else:  # an interior node, or a leaf whose path an operation holds: a tombstone now
                self._drop_checkpoint(node)
            freed += 1
        for node in passed:
            self.mamba_lru.touch(node)
        return freed
