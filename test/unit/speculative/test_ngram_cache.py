"""`NgramCache`, the NGRAM draft source: which continuation a suffix gets, that a request's own newest
suffix never matches itself, the draft-length and capacity bounds, and that indexing a sequence at once
or token by token leaves the same table."""

from __future__ import annotations

import random

from sglang.srt.speculative.ngram_cache import NgramCache
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def cache(lo: int = 1, hi: int = 4, branch: int = 8, capacity: int = 1000) -> NgramCache:
    return NgramCache(lo, hi, branch, capacity)


def test_draft_continues_the_longest_matching_suffix():
    c = cache()
    # "1 2 3" continues with 4 5; "9 3" (a shorter match of the suffix 3) with 7 8.
    seen = [1, 2, 3, 4, 5, 6, 9, 3, 7, 8]
    c.index(seen, 0)
    assert c.draft([0, 1, 2, 3], 3) == [4, 5, 6]  # the 3-gram wins over the later 1-gram "3"
    assert c.draft([0, 5, 3], 3) == [7, 8]  # only "3" matches: its most recent continuation, to the end
    assert c.draft([0, 42], 3) == []  # nothing seen ends with 42


def test_most_recent_occurrence_wins_and_length_is_capped():
    c = cache(branch=2)
    first, second = [5, 6, 1, 1, 1], [5, 6, 2, 2, 2]
    c.index(first, 0)
    c.index(second, 0)
    assert c.draft([5, 6], 10) == [2, 2]  # the newer text, at most branch_length tokens
    assert c.draft([5, 6], 1) == [2]
    assert c.draft([5, 6], 0) == []


def test_own_newest_suffix_does_not_match_itself():
    c = cache()
    tokens = [7, 8, 9]
    c.index(tokens, 0)
    # "7 8 9" was seen only here, ending at the last token: no continuation exists.
    assert c.draft(tokens, 4) == []
    tokens += [7, 8]
    c.index(tokens, 3)
    # Now "7 8" was seen before, followed by 9 7 8 (this very list, grown since).
    assert c.draft(tokens, 4) == [9, 7, 8]


def test_incremental_indexing_matches_indexing_at_once():
    rng = random.Random(0)
    seq = [rng.randrange(6) for _ in range(200)]
    whole, steps = cache(), cache()
    whole.index(list(seq), 0)
    grown: list[int] = []
    i = 0
    while i < len(seq):
        n = rng.randint(1, 5)
        start = len(grown)
        grown += seq[i : i + n]
        steps.index(grown, start)
        i += n
    assert (list(whole._old), list(whole._new)) == (list(steps._old), list(steps._new))  # in the same order
    for probe in range(50):
        suffix = seq[rng.randrange(len(seq)) :][:4] or [0]
        assert whole.draft(suffix, 6) == steps.draft(suffix, 6), probe


def test_capacity_drops_the_older_generation():
    c = cache(lo=1, hi=1, capacity=4)  # two generations of two keys
    c.index([1, 2, 3], 0)  # keys 1, 2: the generation is full and becomes the older one
    assert len(c) == 2 and c.draft([1], 1) == [2]
    c.index([4, 5, 6], 0)  # keys 4, 5 fill the next: keys 1 and 2 go (freed within the call that adds more)
    assert len(c) == 2 and not c._dropped
    assert c.draft([1], 1) == c.draft([2], 1) == []
    assert c.draft([4], 1) == [5] and c.draft([5], 1) == [6]
    c.index([7, 8], 0)  # key 7 starts a new generation beside 4 and 5
    assert len(c) == 3 and c.draft([4], 1) == [5] and c.draft([7], 1) == [8]


def test_a_seed_keeps_its_text_to_itself():
    """Cache namespaces (`namespace_seed`): text indexed under one seed is drafted from under that seed
    only."""
    from sglang.srt.speculative.ngram_cache import namespace_seed

    c = cache()
    a, b = namespace_seed("0" * 31 + "1"), namespace_seed("f" * 32)
    assert namespace_seed(None) == 0 and len({0, a, b}) == 3
    c.index([1, 2, 3, 4, 5, 6], 0, a)
    assert c.draft([9, 2, 3], 3, a) == [4, 5, 6]
    assert c.draft([9, 2, 3], 3, b) == [] and c.draft([9, 2, 3], 3) == []
