"""`NgramCache`: the draft source of `--speculative-algorithm NGRAM`, one table shared by all requests
(keys seeded by their cache namespace, `namespace_seed`: a tenant's drafts never come from another's).

Every position of every sequence seen (a prompt at its request's first decode step, outputs as they are
committed) is indexed under the n-grams that end there, one key per window size w in [min_window,
max_window]; the key maps to where the text continues after that occurrence. A draft for a request is the continuation
of the most recent occurrence of its longest suffix that has one: the text that followed the same
words last time, in this request or in any other (upstream's BFS match with breadth 1: one chain).

A position is indexed only once a token follows it, so a request's own newest suffix never matches
itself. Values point into the sequence lists (`(tokens, start)`) instead of copying continuations:
one insert per new token and window, whatever the draft length. Keys are 61-bit hashes of the n-grams
(built backwards from the n-gram's last token, one multiply-add per window: ~3x cheaper than tuple keys,
which matters for long prompts on the scheduler thread); two n-grams sharing a hash only cost a draft
that verification rejects. About `capacity` keys, in two generations of half that each (a key in both
counts twice): when the newer fills up it becomes the older, and the older one leaves the lookups at
once and is freed a few keys per later `index` call (twice as many as that call adds), so that no call
frees millions of keys on the scheduler thread. A sequence list lives while a key points into it. A key
costs ~70 bytes: upstream's default capacity, 10M keys, is ~0.7 GB of host memory once that much text
was served.
"""

from __future__ import annotations

_MASK = (1 << 61) - 1
_MUL = 1_000_003


def namespace_seed(namespace: str | None) -> int:
    """The key seed of a cache namespace (`Req.extra_key`, a hex digest): its requests draft only from
    text of the same namespace, as their prefix-cache hits come only from it; 0 for the shared one."""
    return 0 if namespace is None else int(namespace[:15], 16) or 1


class NgramCache:
    def __init__(self, min_window: int, max_window: int, branch_length: int, capacity: int):
        assert 1 <= min_window <= max_window and branch_length >= 1 and capacity >= 1
        self.min_window = min_window
        self.max_window = max_window
        self.branch_length = branch_length  # the longest continuation a draft takes
        self.capacity = capacity
        self._generation = max(capacity // 2, 1)
        self._new: dict[int, tuple[list[int], int]] = {}
        self._old: dict[int, tuple[list[int], int]] = {}
        self._dropped: dict[int, tuple[list[int], int]] = {}  # the generation before, being freed

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def index(self, tokens: list[int], start: int, seed: int = 0) -> None:
        """Index the positions of `tokens` (a list that only grows: it is kept and read later) from
        `start` on that a token now follows: call it after appending, with `start` the length before
        (0 for a new sequence). `seed` starts every key's hash: drafts with another seed never find
        these (a cache namespace's, `namespace_seed`)."""
        table, lo, hi = self._new, self.min_window, self.max_window
        for end in range(max(start - 1, 0), len(tokens) - 1):
            # The n-grams ending at position `end`; their text continues at end + 1.
            value, h = (tokens, end + 1), seed
            for w in range(1, min(hi, end + 1) + 1):
                h = (h * _MUL + tokens[end + 1 - w] + 1) & _MASK
                if w >= lo:
                    table[h] = value
            if len(table) >= self._generation:
                self._dropped, self._old, self._new = self._old, table, {}
                table = self._new
        dropped = self._dropped
        for _ in range(min(len(dropped), 2 * (len(tokens) - start) * (hi - lo + 1))):
            dropped.popitem()

    def draft(self, tokens: list[int], max_tokens: int, seed: int = 0) -> list[int]:
        """Up to `max_tokens` tokens that may follow `tokens` (fewer where no indexed text continues
        that far; none where no suffix of `tokens` was seen with the same `seed`)."""
        n = min(max_tokens, self.branch_length)
        if n <= 0:
            return []
        keys, h = [], seed
        for w in range(1, min(self.max_window, len(tokens)) + 1):
            h = (h * _MUL + tokens[-w] + 1) & _MASK
            keys.append(h)
        new, old = self._new, self._old
        for w in range(len(keys), self.min_window - 1, -1):
            hit = new.get(keys[w - 1]) or old.get(keys[w - 1])
            if hit is not None:
                seq, at = hit
                return seq[at : at + n]
        return []
