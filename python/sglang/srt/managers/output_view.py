"""`Appended`: a request's output as it will be once the tokens a batch sampled for it are committed,
read as a list is, without copying the output or changing it. `FinishChecker.precheck` measures a
batch's checks on it before `BatchResultProcessor.commit`, the one place that appends to `output_ids`
(a verify's row: one view per token it may commit, each with the tokens up to that one)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Appended:
    """`base` with `tokens` after it, read as a list is (length, index, slice), without copying `base` or
    changing it."""

    __slots__ = ("base", "tokens")

    def __init__(self, base: list[int], tokens: Sequence[int]):
        self.base, self.tokens = base, tokens

    def __len__(self) -> int:
        return len(self.base) + len(self.tokens)

    def __getitem__(self, i: int | slice) -> Any:
        n = len(self.base)
        total = n + len(self.tokens)
        if isinstance(i, slice):
            start, stop, step = i.indices(total)
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            part = self.base[start : min(stop, n)]  # (empty where the slice starts at or past n)
            if stop > n:
                part = [*part, *self.tokens[max(start - n, 0) : stop - n]]
            return part
        j = i + total if i < 0 else i
        if n <= j < total:
            return self.tokens[j - n]
        if 0 <= j < n:
            return self.base[j]
        raise IndexError(i)
