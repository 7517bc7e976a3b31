"""`DecodeStepLog`: one value per request per decode step, for an unchanged list of requests (the decode
set), kept here per step and appended to each request's own list only when something reads that list.

A decode step gives every running request one more KV slot and one more token. Appending them to each
request's lists at every step is a pass over the requests that touches each request and its lists while
both are cold (the forward ran on the same core since the last step): ~0.2-0.4 us per request and list.
While the decode set stays the same requests in the same order, a step instead records its list of values
here. A request's list property (`Req.kv_indices`, `Req.output_ids`) first appends the steps pending for
that request (`append_pending`); `flush` appends every pending step to every request, as `clear` does
before it forgets the set.

Two logs: `DecodeKVLog` (mem_cache/decode_kv_log.py, the slots) and `DecodeTokenLog`
(scheduler_components/decode_token_log.py, the tokens).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


class DecodeStepLog:
    LIST_ATTR = ""  # the request's list the steps are appended to (its property's backing list)
    MAX_PENDING = 64  # steps kept before everything is appended (64 x 256 values: ~130 KB of lists)
    SCANS = 16  # places found by scanning the decode set before a map of it is built

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False: nothing is ever pending (`DecodeFastPath`)
        # Per step recorded and not yet appended to every request, the value of each of `_reqs` (what
        # the request's list property looks at first).
        self.pending: list[Sequence[int]] = []
        self._reqs: list[Req] = []  # the decode set the pending steps were for, in their order
        self._done: dict[int, int] = {}  # place -> pending steps already appended to that request
        self._scans = 0  # places looked up in this decode set so far
        self._places: dict[int, int] | None = None  # id(req) -> place, once lookups are many

    def append_pending(self, req: Req) -> None:
        """Append the steps pending for `req` (none if it is not in the decode set) to its list."""
        i = self._place(req)
        if i is None:
            return
        done, steps = self._done.get(i, 0), self.pending
        if done < len(steps):
            getattr(req, self.LIST_ATTR).extend([step[i] for step in steps[done:]])
            self._done[i] = len(steps)

    def flush(self) -> None:
        """Append every pending step to every request of the decode set."""
        if not self.pending:
            return
        done, attr = self._done, self.LIST_ATTR
        for i, (r, values) in enumerate(zip(self._reqs, zip(*self.pending, strict=True), strict=True)):
            getattr(r, attr).extend(values[done.get(i, 0) :])
        self.pending = []
        self._done = {}

    def clear(self) -> None:
        """Append everything and forget the decode set (the next step starts a new one)."""
        self.flush()
        self._reqs, self._scans, self._places = [], 0, None

    def _place(self, req: Req) -> int | None:
        """`req`'s place in the decode set, or None. A finish or a snapshot insert asks for a few
        requests per step: a scan each (C-level, identity first) is cheaper than a map of the set."""
        if self._places is None:
            if self._scans < self.SCANS:
                self._scans += 1
                try:
                    return self._reqs.index(req)
                except ValueError:
                    return None
            self._places = {id(r): i for i, r in enumerate(self._reqs)}
        return self._places.get(id(req))
