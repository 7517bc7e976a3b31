"""`HiMambaRadixCache`: the radix cache with a host-memory tier (`--enable-hierarchical-cache`, upstream's
HiCache for hybrid models).

Two trees over the same token space: the device tree (this class, a `MambaRadixCache`: its nodes hold
device KV slots and device checkpoints) and the host tree (`host_tree`, a `HostRadixTree` over the host
pools' allocators: its state eviction keeps each path's deepest checkpoint, `host_tree.py`). A prefix
with a checkpoint is resident on the device, on host, or both: a device checkpoint node whose path and
checkpoint the host tree holds too is "both" (`residency`). Each tree keeps
its own LRU, locks and accounting identity; the host tree's is checked with the device's
(`check_host_integrity`, called by `integrity.check_integrity`).

Backups (device -> host) by `--hicache-write-policy`:
- `write_through`: every checkpoint the device tree takes is backed up (with its path's KV) as soon as
  the batch that writes it has run, but one with a deeper checkpoint due below it in the same batch and
  no branch there, unless it is the one just above a deeper backup (an exact repeat of that one's path
  resumes from it: `take_host_copies`);
- `write_through_selective`: a checkpoint is backed up once it has been hit `SELECTIVE_THRESHOLD` (2)
  times, its insert counting as the first (upstream's rule: write through only what is reused);
- `write_back`: a checkpoint is backed up when the device tree evicts it.
Under every policy a checkpoint whose backup is due but not yet recorded is backed up when evicted. A
backup that finds no room on host after host eviction (interior checkpoints before leaves, LRU within
each; never a node being loaded) is skipped. Nothing of a namespace marked `keep_off_host` (the server's
warm-up's, until the next reset) is backed up or loaded, under any policy.

Loads (host -> device): a match for a request (admission) whose deepest host checkpoint lies deeper than
the device's allocates device KV pages for the part of the path the device lacks and one slot, records
the copies, and inserts that path into the device tree with the slot as its checkpoint; the match then
hits it as any device checkpoint. A node's state is loaded with its KV in the same sealed batch of
copies, never apart. Copies run on the forward stream before the batch (`HiCacheController`).
"""

from __future__ import annotations

import logging
from array import array
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING

from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.base_prefix_cache import MatchResult
from sglang.srt.mem_cache.common import alloc_mamba_slot, evict_from_tree_cache
from sglang.srt.mem_cache.disk_tier import DiskTierConfig, FileStorage, entry_name
from sglang.srt.mem_cache.hicache_controller import HiCacheController
from sglang.srt.mem_cache.host_pool import HostPools
from sglang.srt.mem_cache.host_tree import HostRadixTree
from sglang.srt.mem_cache.integrity import _partition
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.mamba_tree import MambaTree, TreeNode
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool, MHATokenToKVPool

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.tree_cache_factory import TpAgreement

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_back", "write_through_selective")
SELECTIVE_THRESHOLD = 2


def prune_tombstone_leaf(tree: MambaRadixCache, node: TreeNode) -> None:
    if node is not tree.root and node.is_leaf and node.mamba_value is None and node.full_lock_ref == 0:
        tree._evict_leaf(node)


class HiMambaRadixCache(MambaRadixCache):
    def __init__(
        self,
        req_to_token_pool: HybridReqToTokenPool,
        token_allocator: PagedTokenAllocator,
        page_size: int,
        kv_pool: MHATokenToKVPool,
        write_policy: str = "write_through",
        ratio: float = 2.0,
        size_gb: int = 0,
        storage: DiskTierConfig | None = None,
        tp: TpAgreement | None = None,
    ):
        """`storage`: the `file` backend's disk tier (`disk_tier.py`), if any. `tp`: under tensor
        parallelism, how the ranks agree on the host tier's sizes and on disk hits (`tree_cache_factory`);
        every other decision of this class follows from the trees, the same on every rank."""
        assert write_policy in WRITE_POLICIES, write_policy
        self.write_policy = write_policy
        agree = () if tp is None else (tp.smallest, tp.ranks_per_node)
        self.host = HostPools(kv_pool, req_to_token_pool.mamba_pool, ratio, size_gb, *agree)
        self.controller = HiCacheController(self.host)
        owner = SimpleNamespace(
            strategy=SimpleNamespace(
                extra_buffer=True, cache_chunk_size=req_to_token_pool.strategy.cache_chunk_size, lazy=False
            ),
            mamba_allocator=self.host.slot_allocator,
        )
        self.host_tree = HostRadixTree(owner, self.host.token_allocator, page_size)
        self.storage = None if storage is None else FileStorage(storage, self.host, self.controller.stats)
        if self.storage is not None and tp is not None:
            self.storage.gather = tp.gather
        self.due: dict[int, TreeNode] = {}  # checkpoints whose backup is due
        self.hits: dict[int, int] = {}  # write_through_selective: hits per checkpoint node
        self.off_host: set[str] = set()  # namespaces never backed up nor loaded (`keep_off_host`)
        self._loading = False
        super().__init__(req_to_token_pool, token_allocator, page_size)

    def reset(self) -> None:
        super().reset()
        self.host_tree.reset()
        self.host.clear()
        self.controller.seal()  # (what was recorded is dropped)
        if self.storage is not None:
            self.storage.reset()  # (its recorded writes went with the controller's list)
        self.due, self.hits = {}, {}
        self.off_host = set()

    def keep_off_host(self, namespace: str) -> None:
        if namespace is not None:  # (the shared namespace is everyone's)
            self.off_host.add(namespace)

    def weights_changed(self) -> None:
        """An in-place weight update: the disk tier's entries belong to the old weights."""
        if self.storage is not None:
            self.storage.weights_changed()

    # ---- residency -----------------------------------------------------------------------------------

    def _host_end(self, key: list[int], namespace: str | None) -> TreeNode | None:
        """The host node holding a checkpoint exactly at the end of `key`, if any."""
        path, matched = self.host_tree._walk(key, namespace)
        if not path or matched != len(key) or path[-1][0].mamba_value is None:
            return None
        return path[-1][0]

    def residency(self, node: TreeNode) -> str:
        """'both' when the host tier holds this device checkpoint's path and state too, else 'device'
        (prefixes only on host are the host tree's: `host_tree`)."""
        return "both" if self._host_end(node.path_key(), node.namespace) is not None else "device"

    # ---- backups -------------------------------------------------------------------------------------

    def _set_checkpoint(self, node: TreeNode, slot: int) -> None:
        super()._set_checkpoint(node, slot)
        # A checkpoint reaches the tree written by a batch already launched or by the one being prepared
        # (whose copies are sealed already), or filled by a `no_buffer` state copy recorded in the same
        # ordered list as the host copies (`_donate_snapshot`): a backup recorded after it runs after it.
        if node.namespace in self.off_host:
            return
        if self.write_policy == "write_through" and not self._loading:
            self.due[node.id] = node
        elif self.write_policy == "write_through_selective" and not self._loading:
            self.hits[node.id] = 1  # (upstream counts the insert as the first hit)

    def _donate_snapshot(self, req: Req, pos: int, slot: int, copy_from: int | None) -> None:
        super()._donate_snapshot(req, pos, slot, copy_from)
        # The snapshot's state copy joins the host copies' one ordered list: run apart (after them), a
        # load recorded before it into the running slot (freed by an abort, handed out again) would
        # overwrite its source first, and a backup of the snapshot would read it unwritten. Nothing
        # backs the new checkpoint up before this (it is due at `take_host_copies` or when dropped).
        for src, dst in self.pending_state_copies:
            self.controller.state_copy(src, dst)
        self.pending_state_copies = []

    def _drop_checkpoint(self, node: TreeNode) -> None:
        due = node.id in self.due or (self.write_policy == "write_back" and node.namespace not in self.off_host)
        if due:
            self._backup(node)
        self.due.pop(node.id, None)
        self.hits.pop(node.id, None)
        super()._drop_checkpoint(node)

    def _host_room(self, key, ns: str | None, count: str) -> tuple[TreeNode, int] | None:
        """(host node where the host tree's path along `key` ends, its length) once host eviction (never
        that path, `HostRadixTree.make_room`) left room for the rest of `key` and a slot; None (counted) if
        it could not."""
        host_tree = self.host_tree
        path, matched = host_tree._walk(key, ns)
        end = path[-1][0] if path else host_tree.root
        pages = (len(key) - matched) // self.page_size
        extends = matched < len(key)
        held = host_tree.total_size(), host_tree.mamba_total_size()
        room = host_tree.make_room(end, extends, self.host.token_allocator, pages, self.host.slot_allocator)
        if self.storage is not None and held != (host_tree.total_size(), host_tree.mamba_total_size()):
            self.storage.forget_agreed()  # (host checkpoints went: disk entries may be the deepest hits now)
        if not room:
            prune_tombstone_leaf(host_tree, end)
            self.controller.stats[count] += 1
            return None
        return end, matched

    def _host_insert(self, key, ns: str | None, end: TreeNode, matched: int) -> tuple[list, list, int]:
        """Allocate host pages for `key` past `matched` and a slot, insert them into the host tree:
        (new host KV, the whole path's host KV, host slot)."""
        host_tree, page = self.host_tree, self.page_size
        pages = self.host.token_allocator.alloc_pages((len(key) - matched) // page)
        host_slot = self.host.slot_allocator.alloc(1)[0]
        new_kv = [p * page + i for p in pages for i in range(page)]
        host_kv = (end.path_value() if end is not host_tree.root else []) + new_kv
        assert not host_tree.insert(key, host_kv, host_slot, matched, ns).mamba_exist
        return new_kv, host_kv, host_slot

    def _backup(self, node: TreeNode, below: TreeNode | None = None) -> bool:
        """Record the copy of `node`'s path KV (what the host lacks of it) and checkpoint to host and
        insert them into the host tree; False if the host tier has no room even after evicting. `below`:
        a deeper checkpoint on its path backed up just before (the repeat point's): its disk entry holds
        this one's KV, so this one's is state-only (`FileStorage.write`)."""
        key, ns = node.path_key(), node.namespace
        end = self._host_end(key, ns)
        if end is not None:
            self.host_tree.mamba_lru.touch(end)
            return True
        room = self._host_room(key, ns, "backups_no_room")
        if room is None:
            return False
        end, matched = room
        new_kv, host_kv, host_slot = self._host_insert(key, ns, end, matched)
        self.controller.backup(node.path_value()[matched:], new_kv, node.mamba_value, host_slot)
        storage = self.storage
        if storage is not None:
            name = entry_name(key, ns)
            base = None if below is None else entry_name(below.path_key(), ns)
            if storage.wants(name, len(key), state_only=base is not None):
                storage.writing(name)
                write = partial(storage.write, name, len(key), host_kv, host_slot, base)
                self.controller.record(write, "disk_writes")
        return True

    def take_host_copies(self) -> list:
        """Once per batch, at its preparation: record the backups that are due and written, then seal
        every copy recorded so far (the tree's own state copies among them) into this batch. A due
        checkpoint with another one due below it on its path (a request's prefill snapshots, taken in one
        batch) is not backed up unless paths branch there: the deeper backup brings the same KV, and its
        state serves every request the shallower one would but those leaving the path between the two
        (the host tree would drop it first anyway: `host_tree.py`) and the exact repeat of the deeper
        one's path. A match leaves at least the last token to recompute (its logits pick the next token),
        so that repeat resumes from the checkpoint nearest above the deeper one, never from it: that one
        is backed up too, as the device would hit it (its state only: the deeper backup brought the KV,
        and its disk entry refers to the deeper one's for it; counted: `backups_repeat_point`). Where no
        backup below it succeeded (no room on host for the deeper path), the skipped one is backed up
        after all, deepest first."""
        ready = list(self.due.values())
        self.due.clear()
        covered = self._above(ready)
        skipped, backed = {}, []
        for node in ready:
            if node.id in covered and len(node.children) == 1:
                skipped[node.id] = node
            elif self._backup(node):
                backed.append(node)
        for node in list(backed):
            up = self._checkpoint_above(node)
            if up is not None and skipped.pop(up.id, None) is not None and self._backup(up, below=node):
                self.controller.stats["backups_repeat_point"] += 1
                backed.append(up)
        below_a_backup = self._above(backed)
        for node in sorted(skipped.values(), key=TreeNode.path_len, reverse=True):
            if node.id in below_a_backup:
                self.controller.stats["backups_skipped_covered"] += 1
            elif self._backup(node):
                self.controller.stats["backups_covered_retried"] += 1
                below_a_backup |= self._above([node])
        assert not self.pending_state_copies  # (recorded with the host copies: `_donate_snapshot`)
        return self.controller.seal()

    def _checkpoint_above(self, node: TreeNode) -> TreeNode | None:
        """The nearest node above `node` with a checkpoint (None if none but the root)."""
        up = node.parent
        while up is not self.root and up.mamba_value is None:
            up = up.parent
        return None if up is self.root else up

    def _above(self, nodes: list[TreeNode]) -> set[int]:
        """The ids of the nodes' ancestors (the root excluded)."""
        out: set[int] = set()
        for node in nodes:
            up = node.parent
            while up is not self.root and up.id not in out:
                out.add(up.id)
                up = up.parent
        return out

    def run_host_copies(self, copies: list) -> None:
        """On the forward stream, before the batch (or a verify's draft steps): its sealed copies."""
        self.controller.run(copies)

    def settle_host_copies(self, call) -> None:  # noqa: ANN001 - ForwardWorker.call
        """PD decode, before destinations are cleared and sent to the prefill server (whose transfer
        writes them from outside the forward stream): every host copy recorded or sealed so far has run,
        so none reads a page or slot the transfer writes (a backup of a page the tree gave up and the
        destination got) or lands late. `call` runs a function on the forward stream after every batch
        launched so far and returns once it ran."""
        copies = self.take_host_copies()

        def run() -> None:
            self.controller.run(copies)
            self.controller.wait()  # (queued is not done: wait for the copies and their landing)

        call(run)

    # ---- loads ---------------------------------------------------------------------------------------

    def match_prefix(
        self, key: list[int], cow_mamba: bool = False, req: Req | None = None, namespace: str | None = None
    ) -> MatchResult:
        if req is not None and req.extra_key not in self.off_host:
            self._load_from_host(key, req.extra_key)
        res = super().match_prefix(key, cow_mamba, req, namespace)
        node = res.last_device_node
        selective = self.write_policy == "write_through_selective" and node.namespace not in self.off_host
        if req is not None and selective and node is not self.root:
            self.hits[node.id] = self.hits.get(node.id, 0) + 1
            if self.hits[node.id] >= SELECTIVE_THRESHOLD:
                self.due[node.id] = node
        return res

    def _deepest_checkpoint(self, tree: MambaTree, key: array, ns: str | None) -> tuple[TreeNode | None, int]:
        path, _ = tree._walk(key, ns)
        best, depth = None, 0
        for child, start in path:
            if child.mamba_value is not None:
                best, depth = child, start + len(child.key)
        return best, depth

    def _load_from_disk(self, key: array, ns: str | None) -> None:
        """A disk entry deeper than anything the host and device trees hold along `key` goes into the host
        tree: read and checked now (`FileStorage.stage`; a failed read drops the entry and the hit), its
        KV the host lacks and its state written into the host pools on the forward stream."""
        depth, name = self.storage.deepest(key, ns)
        if depth == 0:
            return
        if self._deepest_checkpoint(self.host_tree, key, ns)[1] >= depth:
            return
        if self._deepest_checkpoint(self, key, ns)[1] >= depth:
            return
        room = self._host_room(key[:depth], ns, "disk_loads_no_room")
        if room is None:
            return
        end, matched = room
        staged = self.storage.stage(name, matched)
        if staged is None:
            prune_tombstone_leaf(self.host_tree, end)
            return
        new_kv, _, host_slot = self._host_insert(key[:depth], ns, end, matched)
        self.controller.record(partial(self.storage.apply, staged, new_kv, host_slot), "disk_reads")

    def _load_from_host(self, key: list[int], ns: str | None) -> None:
        key = key[: self._page_aligned(len(key))]
        key = key if isinstance(key, array) else array("q", key)
        if self.storage is not None and key:
            self._load_from_disk(key, ns)
        host_tree = self.host_tree
        if not host_tree.root.children:
            return
        src, depth = self._deepest_checkpoint(host_tree, key, ns)
        if src is None or self._deepest_checkpoint(self, key, ns)[1] >= depth:
            return  # nothing on host, or the device holds a checkpoint as deep already
        dpath, dev_matched = self._walk(key[:depth], ns)
        host_tree.inc_lock_ref(src)
        dev_end = dpath[-1][0] if dpath else self.root
        self.hold_path(dev_end, 1)
        need = (depth - dev_matched) // self.page_size
        room = evict_from_tree_cache(self, self.token_allocator, need)
        slot = alloc_mamba_slot(self, self.mamba_allocator)[0] if room else None
        self.hold_path(dev_end, -1)
        if slot is None:
            host_tree.dec_lock_ref(src)
            prune_tombstone_leaf(self, dev_end)
            self.controller.stats["loads_no_room"] += 1
            return
        page = self.page_size
        new_kv = [p * page + i for p in self.token_allocator.alloc_pages(need) for i in range(page)]
        dev_kv = (dev_end.path_value() if dev_end is not self.root else []) + new_kv
        self._loading = True
        try:
            res = self.insert(key[:depth], dev_kv, slot, dev_matched, ns)
        finally:
            self._loading = False
        assert not res.mamba_exist
        host_kv = src.path_value()
        self.controller.load(host_kv[dev_matched:depth], new_kv, src.mamba_value, slot)
        host_tree.mamba_lru.touch(src)
        host_tree.dec_lock_ref(src)
        self.controller.stats["host_hit_tokens"] += depth

    # ---- accounting ----------------------------------------------------------------------------------

    def check_host_integrity(self) -> None:
        """The host tier's identity (free + held by the host tree == total, for host KV pages and state
        slots, none held twice), the host tree's invariants, no host lock left, and the device-side
        bookkeeping naming only live device checkpoints."""
        host_tree, host = self.host_tree, self.host
        host_tree.sanity_check()
        alloc, slots = host.token_allocator, host.slot_allocator
        _partition(
            "host KV page",
            set(range(1, alloc.num_pages + 1)),
            {
                "free": list(alloc._free_pages),
                "tree": sorted({t // alloc.page_size for t in host_tree.held_kv_slots()}),
            },
        )
        _partition(
            "host state slot",
            set(range(1, slots.size + 1)),
            {"free": list(slots._free), "tree": host_tree.held_mamba_slots()},
        )
        assert all(n.full_lock_ref == 0 for n in host_tree.nodes() if n is not host_tree.root), (
            "host lock left"
        )
        live = {n.id for n in self.nodes() if n.mamba_value is not None}
        assert set(self.due) <= live and set(self.hits) <= live

    def host_counts(self) -> tuple[int, int]:
        """(host KV pages, host slots) accounted by counts: free + held by the host tree - total (0, 0)."""
        alloc, slots, t = self.host.token_allocator, self.host.slot_allocator, self.host_tree
        return (
            alloc.free_pages() + t.total_size() // alloc.page_size - alloc.num_pages,
            slots.free_list_size() + t.mamba_total_size() - slots.size,
        )
