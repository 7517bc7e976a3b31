"""`DecodeStepLog`: one value per request per decode step, for an unchanged list of requests (the decode
set), kept here per step and appended to each request's own list at the next boundary that reads it.

A decode step gives every running request one more KV slot and one more token. Appending them to each
request's lists at every step is a pass over the requests that touches each request and its lists while
both are cold (the forward ran on the same core since the last step): ~0.2-0.4 us per request and list.
While the decode set stays the same requests in the same order, a step instead records its list of values
here. Nothing reads a request's lists in such a step; the scheduler's `DecodeFastPath` appends every
pending step (`flush`) at each boundary that does (a finish, a retraction, an abort, a new decode set, a
decode build that reads the newest tokens, the integrity check). The lists are plain: a read has no side
effect, and one that comes before its boundary's flush reads a short list (the integrity check's guard,
`DecodeFastPath.check`, fails where a log holds steps of a request that left the running set).

Two logs: `DecodeKVLog` (mem_cache/decode_kv_log.py, the slots) and `DecodeTokenLog`
(scheduler_components/decode_token_log.py, the tokens, committed by `batch_result_processor.commit_logged`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


class DecodeStepLog:
    MAX_PENDING = 64  # steps kept before everything is appended (64 x 256 values: ~130 KB of lists)
    SCANS = 16  # places found by scanning the decode set before a map of it is built

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled  # False: nothing is ever pending (`DecodeFastPath`)
        # Per step recorded and not yet appended to every request, the value of each of `_reqs`, in
        # their order.
        self.pending: list[Sequence[int]] = []
        self._reqs: list[Req] = []  # the decode set the pending steps are for
        self._done: dict[int, int] = {}  # place -> pending steps already taken for that request alone
        self._scans = 0  # places looked up in this decode set so far
        self._places: dict[int, int] | None = None  # id(req) -> place, once lookups are many

    def take(self, req: Req | None = None) -> list[tuple[Req, Sequence[int]]]:
        """Each request of the decode set (or `req` alone, if it is one) with the values of the pending
        steps not taken for it yet, in step order; the caller appends them to the request's list. Taking
        them all empties the log."""
        steps = self.pending
        if not steps:
            return []
        done = self._done
        if req is None:
            columns = zip(*steps, strict=True)
            taken = [
                (r, v[done.get(i, 0) :]) for i, (r, v) in enumerate(zip(self._reqs, columns, strict=True))
            ]
            self.pending, self._done = [], {}
            return taken
        i = self._place(req)
        if i is None or done.get(i, 0) == len(steps):
            return []
        first, done[i] = done.get(i, 0), len(steps)
        return [(req, [step[i] for step in steps[first:]])]

    def lacking(self) -> list[int]:
        """How many pending steps each request of the decode set has not taken yet."""
        n, done = len(self.pending), self._done
        return [n - done.get(i, 0) for i in range(len(self._reqs))]

    def forget(self) -> None:
        """Forget the decode set (nothing may be pending)."""
        assert not self.pending, f"{type(self).__name__} forgets its set with steps not appended"
        self._reqs, self._scans, self._places = [], 0, None

    def check_members(self, running: list[Req]) -> None:
        """The guard of the integrity check: steps wait only for requests still running (one that
        finished, was aborted, retracted or handed over was flushed on its way out)."""
        if not self.pending:
            return
        running_ids = {id(r) for r in running}
        gone = [r for r, n in zip(self._reqs, self.lacking(), strict=True) if n and id(r) not in running_ids]
        name, n = type(self).__name__, len(self.pending)
        assert not gone, f"{name} holds {n} step(s) of requests no longer running: {gone}"

    def _place(self, req: Req) -> int | None:
        """`req`'s place in the decode set, or None. A snapshot insert asks for a few requests per step:
        a scan each (C-level, identity first) is cheaper than a map of the set."""
        if self._places is None:
            if self._scans < self.SCANS:
                self._scans += 1
                try:
                    return self._reqs.index(req)
                except ValueError:
                    return None
            self._places = {id(r): i for i, r in enumerate(self._reqs)}
        return self._places.get(id(req))
