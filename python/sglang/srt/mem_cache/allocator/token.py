"""`PagedTokenAllocator`: KV token slots handed out a page at a time, as host ints.

Token slot t lives in page t // page_size. Page 0 is the KV pool's dummy page (padded rows write there)
and is never handed out, so valid slots are [page_size, (num_pages + 1) * page_size). A request fills
its pages in order: position i of a request sits in the page of position i - 1 unless i is a multiple
of the page size. Frees are by page; a page is owned by exactly one holder (a request or the tree).
The free list is an `array('q')`: a Python list of millions of ints would be walked by every full
collection of the cyclic garbage collector (tens of milliseconds on the scheduler thread).
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable


class PagedTokenAllocator:
    def __init__(self, num_tokens: int, page_size: int = 1):
        if page_size < 1:
            raise ValueError("page_size must be positive")
        self.page_size = page_size
        self.num_pages = num_tokens // page_size
        if self.num_pages < 1:
            raise ValueError(f"A KV pool of {num_tokens} tokens holds no page of {page_size} tokens.")
        self._free_pages = array("q", range(self.num_pages, 0, -1))

    @property
    def size(self) -> int:
        """Capacity in tokens."""
        return self.num_pages * self.page_size

    def available_size(self) -> int:
        return len(self._free_pages) * self.page_size

    def free_pages(self) -> int:
        return len(self._free_pages)

    def alloc_pages(self, n: int) -> list[int] | None:
        if n > len(self._free_pages):
            return None
        if n <= 0:
            return []
        out = list(reversed(self._free_pages[-n:]))
        del self._free_pages[-n:]
        return out

    def alloc_extend(self, prefix_len: int, seq_len: int, last_loc: int) -> list[int] | None:
        """Slots for positions [prefix_len, seq_len) of a request whose position prefix_len - 1 sits
        at slot `last_loc` (ignored when prefix_len is a page boundary); None if pages run out."""
        p = self.page_size
        new_pages = -(-seq_len // p) - -(-prefix_len // p)
        pages = self.alloc_pages(new_pages)
        if pages is None:
            return None
        out: list[int] = []
        page_iter = iter(pages)
        loc = last_loc
        for pos in range(prefix_len, seq_len):
            loc = next(page_iter) * p if pos % p == 0 else loc + 1
            out.append(loc)
        return out

    def needed_pages(self, prefix_len: int, seq_len: int) -> int:
        p = self.page_size
        return -(-seq_len // p) - -(-prefix_len // p)

    def free(self, token_slots: Iterable[int]) -> None:
        """Free the pages of these slots. Callers pass whole pages they own (every slot of a partial
        trailing page they own counts as owning it)."""
        p = self.page_size
        # Slots are pages at page size 1 (an owner's slots are distinct): no set of them.
        pages = sorted(token_slots if p == 1 else {t // p for t in token_slots}, reverse=True)
        if pages and not (0 < pages[-1] and pages[0] <= self.num_pages):
            bad = pages[-1] if pages[-1] <= 0 else pages[0]
            raise AssertionError(f"slot page {bad} is outside the pool")
        self._free_pages.extend(pages)

    def clear(self) -> None:
        self._free_pages = array("q", range(self.num_pages, 0, -1))
