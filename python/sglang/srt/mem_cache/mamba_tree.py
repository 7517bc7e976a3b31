"""Nodes of the mamba radix tree and its two LRU lists.

A node holds a run of tokens (`key`), their KV slots (`value`), and optionally a checkpoint
(`mamba_value`: the slot holding the recurrent state exactly after the node's last token). A node
without a checkpoint is a tombstone. Keys and values are `array('q')`: compact, and invisible to Python's
cyclic garbage collector, which otherwise walks every slot id of a large tree on each full collection
(a long pause for a tree of thousands of nodes; timings: benchmark/README.md).

Locks. A request's lock always covers its KV: a full lock on every node of the path to the root. A
pinning lock (`inc_lock_ref(node)`, what a match takes) also holds the node's checkpoint (mamba lock),
which then cannot be evicted; a KV-only lock (`pin_checkpoint=False`, what an `extra_buffer_lazy` request
takes on its newest snapshot) leaves the checkpoint evictable, so a running request's snapshots cost it
no slot. Evicting the checkpoint of a node held by a KV-only lock leaves a tombstone there (its KV stays
protected), deleted when the lock goes.

Invariants (checked by `MambaTree.sanity_check`):
  1. mamba_lock_ref > 0 implies full_lock_ref > 0; a full lock covers the whole path to the root, a
     mamba lock only its node.
  2. A leaf is never a tombstone unless a KV-only lock holds it (tombstone leaves are deleted eagerly).
  3. The full LRU holds every non-root node; the mamba LRU holds exactly the nodes with a checkpoint.
  4. The locks held directly on a node (its full locks minus its children's) are its mamba locks plus
     its KV-only locks (`kv_only_locks`, by holder).
"""

from __future__ import annotations

import itertools
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

_ids = itertools.count()


class TreeNode:
    __slots__ = (
        "id",
        "children",
        "parent",
        "key",
        "value",
        "mamba_value",
        "full_lock_ref",
        "mamba_lock_ref",
        "namespace",
    )

    def __init__(
        self,
        key: Iterable[int] = (),
        value: Iterable[int] = (),
        parent: TreeNode | None = None,
        namespace: str | None = None,
    ):
        self.id = next(_ids)
        # The prefix-cache namespace of every sequence through this node (`Req.extra_key`): a node's
        # key in its parent's children carries it, so a walk in one namespace never enters another's.
        self.namespace = namespace
        self.children: dict = {}
        self.parent = parent
        self.key = array("q", key)
        self.value = array("q", value)
        self.mamba_value: int | None = None
        self.full_lock_ref = 0
        self.mamba_lock_ref = 0

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def path_len(self) -> int:
        n, node = 0, self
        while node is not None:
            n += len(node.key)
            node = node.parent
        return n

    def path_key(self) -> list[int]:
        """The token ids from the root to this node."""
        return self._along_path("key")

    def path_value(self) -> list[int]:
        """The KV slots from the root to this node."""
        return self._along_path("value")

    def _along_path(self, field: str) -> list[int]:
        parts, node = [], self
        while node is not None:
            parts.append(getattr(node, field))
            node = node.parent
        out: list[int] = []
        for part in reversed(parts):
            out.extend(part)
        return out

    def __repr__(self) -> str:
        state = "ckpt" if self.mamba_value is not None else "tomb"
        return f"TreeNode(id={self.id}, len={len(self.key)}, {state}, locks={self.full_lock_ref}/{self.mamba_lock_ref})"


class LRUList:
    """Least-recently-used order over nodes, a doubly linked list with O(1) insert, remove, refresh
    and insert-before. Iteration starts at the least recently used node."""

    def __init__(self) -> None:
        self._head = TreeNode()  # sentinel before the least recently used node
        self._tail = TreeNode()  # sentinel after the most recently used node
        self._prev: dict[int, TreeNode] = {self._tail.id: self._head}
        self._next: dict[int, TreeNode] = {self._head.id: self._tail}

    def __len__(self) -> int:
        return len(self._next) - 1

    def __contains__(self, node: TreeNode) -> bool:
        return node.id in self._prev and node is not self._tail

    def _link_before(self, node: TreeNode, ref: TreeNode) -> None:
        assert node.id not in self._next, f"{node} is already in this LRU list"
        before = self._prev[ref.id]
        self._next[before.id] = node
        self._prev[node.id] = before
        self._next[node.id] = ref
        self._prev[ref.id] = node

    def insert_mru(self, node: TreeNode) -> None:
        self._link_before(node, self._tail)

    def insert_before(self, node: TreeNode, ref: TreeNode) -> None:
        """Insert `node` just less recently used than `ref` (a new parent split off `ref`)."""
        self._link_before(node, ref)

    def remove(self, node: TreeNode) -> None:
        before, after = self._prev.pop(node.id), self._next.pop(node.id)
        self._next[before.id] = after
        self._prev[after.id] = before

    def touch(self, node: TreeNode) -> None:
        self.remove(node)
        self.insert_mru(node)

    def touch_path(self, node: TreeNode, root: TreeNode) -> None:
        """Refresh `node` and its ancestors, ancestors first, so a child stays more recent than its
        parent (leaves then evict before their parents)."""
        path = []
        while node is not None and node is not root:
            path.append(node)
            node = node.parent
        for n in reversed(path):
            self.touch(n)

    def __iter__(self) -> Iterator[TreeNode]:
        """From least to most recently used; safe against removal of the node just yielded."""
        node = self._next[self._head.id]
        while node is not self._tail:
            after = self._next[node.id]
            yield node
            node = after


def common_prefix_len(a: Sequence[int], b: Sequence[int], start: int, limit: int) -> int:
    """How many of a[:limit] equal b[start:start + limit], counted from the front. Blocks are compared
    as slices (one C call each: a memcmp for two int64 arrays, as `_walk` passes, where element by
    element in Python a long key is slow): a block that matches doubles the next one, one that does not
    is halved, and blocks of 16 or fewer tokens are compared one by one. Slices of different types
    never compare equal, so mixed inputs stay correct, element by element."""
    n, block = 0, 64
    while n < limit:
        m = min(block, limit - n)
        if m > 16:
            if a[n : n + m] == b[start + n : start + n + m]:
                n, block = n + m, block * 2
            else:
                block = m // 2
            continue
        end = n + m
        while n < end and a[n] == b[start + n]:
            n += 1
        if n < end:
            break
    return n


class MambaTree:
    """The radix structure of `MambaRadixCache`: nodes, the two LRU lists, locks and the size counters
    they move (KV slots and checkpoints, each evictable or protected by a lock). The cache adds what
    requests do with it: matches, inserts, donations and eviction."""

    page_size: int

    def reset_tree(self) -> None:
        self.root = TreeNode()
        self.root.full_lock_ref = 1
        self.full_lru = LRUList()
        self.mamba_lru = LRUList()
        self.full_evictable_size_ = 0
        self.full_protected_size_ = 0
        self.mamba_evictable_size_ = 0
        self.mamba_protected_size_ = 0
        # The node each KV-only lock holds, by its holder's id (a request's `id()`).
        self.kv_only_locks: dict[int, TreeNode] = {}

    # ---- keys --------------------------------------------------------------------------------------

    def _child_key(self, key: list[int], start: int = 0, namespace: str | None = None):
        page = key[start] if self.page_size == 1 else tuple(key[start : start + self.page_size])
        return page if namespace is None else (namespace, page)

    def _match_len(self, node_key: list[int], key: list[int], start: int) -> int:
        """Common prefix of node_key and key[start:], in whole pages."""
        n = common_prefix_len(node_key, key, start, min(len(node_key), len(key) - start))
        return n - n % self.page_size

    def _page_aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _walk(self, key: list[int], namespace: str | None = None) -> tuple[list[tuple[TreeNode, int]], int]:
        """The one tree walk of match and insert: descend along `key` (page-aligned) in `namespace`,
        splitting a node that matches only in part. Returns the path's nodes below the root, each with
        the key offset it starts at, and the matched length."""
        # Node keys are int64 arrays: the key as one too makes each block compare a memcmp (a list slice
        # never equals an array slice; the conversion costs less per token than comparing element by
        # element: benchmark/README.md).
        key = key if isinstance(key, array) else array("q", key)
        node, matched = self.root, 0
        path: list[tuple[TreeNode, int]] = []
        while matched < len(key):
            child = node.children.get(self._child_key(key, matched, namespace))
            n = 0 if child is None else self._match_len(child.key, key, matched)
            if n == 0:
                break
            if n < len(child.key):
                child = self._split_node(child, n)
            path.append((child, matched))
            node, matched = child, matched + n
        return path, matched

    def _split_node(self, child: TreeNode, n: int) -> TreeNode:
        """Split `child` after n tokens; the new parent is a tombstone (a state cannot be split) and
        inherits the full locks of the path through it."""
        parent, ns = child.parent, child.namespace
        new = TreeNode(child.key[:n], child.value[:n], parent, ns)
        new.full_lock_ref = child.full_lock_ref
        child.key, child.value, child.parent = child.key[n:], child.value[n:], new
        new.children[self._child_key(child.key, 0, ns)] = child
        parent.children[self._child_key(new.key, 0, ns)] = new
        self.full_lru.insert_before(new, child)
        return new

    # ---- locks -------------------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode, pin_checkpoint: bool = True) -> None:
        if node is self.root:
            return
        assert node.mamba_value is not None, "requests lock only nodes with a checkpoint"
        if pin_checkpoint:
            if node.mamba_lock_ref == 0:
                self.mamba_evictable_size_ -= 1
                self.mamba_protected_size_ += 1
            node.mamba_lock_ref += 1
        self.hold_path(node, 1)

    def dec_lock_ref(self, node: TreeNode, pin_checkpoint: bool = True) -> None:
        if node is self.root:
            return
        if pin_checkpoint:
            assert node.mamba_lock_ref > 0
            node.mamba_lock_ref -= 1
            if node.mamba_lock_ref == 0:
                self.mamba_evictable_size_ += 1
                self.mamba_protected_size_ -= 1
        self.hold_path(node, -1)

    def hold_path(self, node: TreeNode, delta: int) -> None:
        """The KV part of a lock (delta 1) or of its release (-1): every node from `node` up to the root,
        whatever it holds (the host tier also holds a tombstone's path for the span of one operation)."""
        while node is not self.root:
            assert node.full_lock_ref + delta >= 0
            node.full_lock_ref += delta
            if node.full_lock_ref == (1 if delta > 0 else 0):  # (crossed zero)
                self.full_evictable_size_ -= delta * len(node.value)
                self.full_protected_size_ += delta * len(node.value)
            node = node.parent

    # ---- sizes and accounting ----------------------------------------------------------------------

    def evictable_size(self) -> int:
        return self.full_evictable_size_

    def protected_size(self) -> int:
        return self.full_protected_size_

    def mamba_evictable_size(self) -> int:
        return self.mamba_evictable_size_

    def mamba_protected_size(self) -> int:
        return self.mamba_protected_size_

    def nodes(self) -> list[TreeNode]:
        out, stack = [], [self.root]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def held_kv_slots(self) -> list[int]:
        out: list[int] = []
        for n in self.nodes():
            out.extend(n.value)
        return out

    def held_mamba_slots(self) -> list[int]:
        return [n.mamba_value for n in self.nodes() if n.mamba_value is not None]

    def total_size(self) -> int:
        return self.full_evictable_size_ + self.full_protected_size_

    def mamba_total_size(self) -> int:
        return self.mamba_evictable_size_ + self.mamba_protected_size_

    # ---- sanity ------------------------------------------------------------------------------------

    def sanity_check(self) -> None:
        """The invariants above, the lock rules and the size counters; raises AssertionError on a
        violation."""
        root = self.root
        non_root = [n for n in self.nodes() if n is not root]
        assert len(self.full_lru) == len(non_root), "the full LRU must hold every non-root node"
        assert all(n in self.full_lru for n in non_root)
        with_ckpt = [n for n in non_root if n.mamba_value is not None]
        assert len(self.mamba_lru) == len(with_ckpt), "the mamba LRU must hold exactly the checkpoints"
        assert all(n in self.mamba_lru for n in with_ckpt)
        assert root.mamba_value is None and root.full_lock_ref == 1
        full = [0, 0]  # evictable, protected
        mamba = [0, 0]
        kv_only = Counter(n.id for n in self.kv_only_locks.values())
        for n in non_root:
            assert n.key and len(n.key) == len(n.value) and len(n.key) % self.page_size == 0
            assert n.parent.children.get(self._child_key(n.key, 0, n.namespace)) is n
            assert n.parent is root or n.parent.namespace == n.namespace, f"{n} left its namespace"
            held = kv_only.get(n.id, 0)
            assert not (n.is_leaf and n.mamba_value is None and not held), f"tombstone leaf {n}"
            direct = n.full_lock_ref - sum(c.full_lock_ref for c in n.children.values())
            assert direct >= 0, f"{n} has fewer full locks than its children"
            assert n.mamba_lock_ref + held == direct, f"{n}: mamba + KV-only locks != direct locks"
            if n.mamba_value is None:
                assert n.mamba_lock_ref == 0, f"pinned tombstone {n}"
            else:
                mamba[n.mamba_lock_ref > 0] += 1
            full[n.full_lock_ref > 0] += len(n.value)
        assert full == [self.full_evictable_size_, self.full_protected_size_]
        assert mamba == [self.mamba_evictable_size_, self.mamba_protected_size_]
        kv = self.held_kv_slots()
        assert len(kv) == len(set(kv)), "a KV slot appears twice in the tree"
        ckpts = self.held_mamba_slots()
        assert len(ckpts) == len(set(ckpts)), "a checkpoint slot appears twice in the tree"
