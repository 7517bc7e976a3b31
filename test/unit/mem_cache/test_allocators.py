"""Slot and page allocators: exact counts, failure reported (never asserted), grouped allocation."""

from __future__ import annotations

import pytest

from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def test_mamba_alloc_free_and_exhaustion():
    a = MambaSlotAllocator(4)
    assert a.available_size() == 4
    got = a.alloc(3)
    assert sorted(got) == [1, 2, 3] and a.available_size() == 1
    assert a.alloc(2) is None and a.available_size() == 1, "failure takes nothing"
    assert a.alloc(1) == [4] and a.alloc(1) is None
    a.free(got)
    assert a.available_size() == 3 and a.alloc(0) == []


def test_group_returns_unused_slots_and_counts_as_available():
    a = MambaSlotAllocator(10)
    assert a.alloc_group_begin(4) == 4
    assert a.group_size() == 4 and a.free_list_size() == 6 and a.available_size() == 10
    s1, s2 = a.alloc(1), a.alloc(1)
    assert a.group_size() == 2 and a.free_list_size() == 6
    a.alloc_group_end()
    assert not a.group_open and a.available_size() == 8 and a.free_list_size() == 8
    assert set(s1 + s2).isdisjoint(a.alloc(8))


def test_group_is_capped_by_the_free_list():
    a = MambaSlotAllocator(3)
    a.alloc(2)
    assert a.alloc_group_begin(50) == 1
    a.alloc_group_end()


def test_alloc_falls_back_to_the_free_list_when_the_group_is_empty():
    a = MambaSlotAllocator(5)
    with a.alloc_group(1):
        first = a.alloc(1)
        assert a.group_size() == 0
        second = a.alloc(1)
        assert second is not None and second != first and a.free_list_size() == 3


def test_multi_slot_alloc_inside_a_group_uses_group_and_free_list():
    a = MambaSlotAllocator(5)
    with a.alloc_group(3):
        got = a.alloc(4)
        assert got is not None and len(set(got)) == 4
        assert a.group_size() == 0 and a.free_list_size() == 1
        assert a.alloc(2) is None, "only one slot is left anywhere"
    assert a.available_size() == 1


def test_an_exception_inside_the_group_returns_it():
    a = MambaSlotAllocator(6)
    with pytest.raises(RuntimeError), a.alloc_group(5):
        a.alloc(1)
        raise RuntimeError("admission failed")
    assert not a.group_open and a.available_size() == 5
    with pytest.raises(AssertionError):
        a.alloc_group_begin(1)
        a.alloc_group_begin(1)


def test_paged_alloc_extend_fills_pages_in_order():
    t = PagedTokenAllocator(64, page_size=4)
    assert t.num_pages == 16 and t.available_size() == 64
    first = t.alloc_extend(0, 6, 0)
    assert len(first) == 6 and first[1] == first[0] + 1 and first[4] == first[5] - 1
    assert first[0] % 4 == 0 and first[4] % 4 == 0
    assert t.free_pages() == 14
    more = t.alloc_extend(6, 9, first[-1])
    assert more[0] == first[-1] + 1 and more[1] == first[-1] + 2, "positions 6, 7 finish the second page"
    assert more[2] % 4 == 0 and t.free_pages() == 13
    assert all(s >= 4 for s in first + more), "page 0 is the dummy page"
    t.free(first + more)
    assert t.free_pages() == 16


def test_paged_alloc_reports_exhaustion():
    t = PagedTokenAllocator(8, page_size=4)
    assert t.alloc_extend(0, 9, 0) is None and t.free_pages() == 2
    assert t.needed_pages(3, 9) == 2 and t.needed_pages(4, 8) == 1
    with pytest.raises(ValueError):
        PagedTokenAllocator(3, page_size=4)
