"""`Appended`: a request's output as it will be once the tokens a batch sampled for it are committed,
read as a list is, without copying the output or changing it. `FinishChecker.precheck` measures a
batch's checks on it before `BatchResultProcessor.commit`, the one place that appends to `output_ids`."""

from __future__ import annotations

from typing import Any


class Appended:
    """`base` with `token` after it, read as a list is (length, index, slice), without copying `base` or
    changing it."""

    __slots__ = ("base", "token")

    def __init__(self, base: list[int], token: int):
        self.base, self.token = base, token

    def __len__(self) -> int:
        return len(self.base) + 1

    def __getitem__(self, i: int | slice) -> Any:
        n = len(self.base)
        if isinstance(i, slice):
            start, stop, step = i.indices(n + 1)
            if step != 1:
                return [self[j] for j in range(start, stop, step)]
            part = self.base[start : min(stop, n)]
            return [*part, self.token] if start <= n < stop else part
        j = i + n + 1 if i < 0 else i
        if j == n:
            return self.token
        if 0 <= j < n:
            return self.base[j]
        raise IndexError(i)
