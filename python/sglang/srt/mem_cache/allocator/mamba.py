"""`MambaSlotAllocator`: the free list of mamba pool slots, as host ints.

Slot 0 is the pool's dummy row and is never handed out. Every call that can run out reports it to the
caller (`None`); nothing here asserts on a full pool.

Grouped allocation (upstream PR #25000): the scheduler opens a group around one prefill admission pass
with `alloc_group_begin(n)`, which moves up to n slots off the free list in one operation; `alloc(1)`
inside the pass then pops from the group, and `alloc_group_end()` returns what is left. The group is a
reservation for speed, not a partition: slots in an open group still count as available, and `alloc(n)`
(any n) draws from the group before the free list, so nothing fails because a group holds slots. The
caller caps n at what one pass can admit, never the waiting-queue length.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager


class MambaSlotAllocator:
    def __init__(self, size: int):
        if size < 1:
            raise ValueError("The mamba pool needs at least one slot.")
        self.size = size
        # Popped from the end: slot 1 first, so tests and dumps are easy to read. An array, not a list:
        # the cyclic garbage collector does not walk it.
        self._free = array("q", range(size, 0, -1))
        self._group: list[int] | None = None

    def available_size(self) -> int:
        return len(self._free) + len(self._group or ())

    def free_list_size(self) -> int:
        return len(self._free)

    def group_size(self) -> int:
        """Slots reserved by the open group and not yet handed out."""
        return len(self._group or ())

    @property
    def group_open(self) -> bool:
        return self._group is not None

    def alloc(self, n: int = 1) -> list[int] | None:
        """n slots, or None (and nothing taken) if fewer than n are available."""
        if n <= 0:
            return []
        group = self._group
        if group is not None:
            if n <= len(group):
                out = group[-n:]
                del group[-n:]
                return out
            if n > len(group) + len(self._free):
                return None
            out = group[:]
            group.clear()
            n -= len(out)
        else:
            if n > len(self._free):
                return None
            out = []
        out += self._free[-n:]
        del self._free[-n:]
        return out

    def free(self, slots: Sequence[int]) -> None:
        for s in slots:
            assert 0 < s <= self.size, f"slot {s} is outside the pool"
        self._free.extend(slots)

    def alloc_group_begin(self, n: int) -> int:
        """Reserve up to n slots for one admission pass; returns how many were reserved."""
        assert self._group is None, "a slot group is already open"
        n = max(0, min(n, len(self._free)))
        self._group = list(self._free[-n:]) if n else []
        if n:
            del self._free[-n:]
        return n

    def alloc_group_end(self) -> None:
        """Return the group's unused slots to the free list and close it."""
        if self._group is None:
            return
        self._free.extend(reversed(self._group))
        self._group = None

    @contextmanager
    def alloc_group(self, n: int) -> Iterator[int]:
        """`with allocator.alloc_group(n):` - the unused slots return even if the body raises."""
        reserved = self.alloc_group_begin(n)
        try:
            yield reserved
        finally:
            self.alloc_group_end()

    def clear(self) -> None:
        self._free = array("q", range(self.size, 0, -1))
        self._group = None
