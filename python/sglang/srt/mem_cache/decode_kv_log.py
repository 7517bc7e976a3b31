"""`DecodeKVLog`: the KV slots that decode steps give an unchanged list of requests, kept per step and
appended to each request's `kv_indices` only when something reads that list.

A decode step gives every running request one more KV slot (with `--page-size 1`, its own page). Appending
it to each request's list at every step is a pass over the requests that touches each request and its
list while both are cold (the forward ran on the same core since the last step): ~0.3-0.4 us per request,
a quarter of a steady step's host time at 256 requests. While the decode set stays the same requests in
the same order, a step instead records its slot list here, and each request's KV length follows from the
previous step's (+1 each).

Nothing reads a request's list in a steady step; what does (a finish, a retraction, a snapshot insert at a
track boundary, a dirty-row rewrite, the integrity checks) goes through `Req.kv_indices`, which first
appends the steps pending for that request (`append_pending`). The whole log is appended when the decode
set changes (the new set's first step is appended at once, in the pass that reads the lengths), and
every `MAX_PENDING` steps, which bounds its memory.

Used for page size 1 only (`alloc_for_decode`): with larger pages a step's slot depends on each request's
last slot, which a snapshot insert may have replaced in its list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


class DecodeKVLog:
    MAX_PENDING = 64  # steps kept before everything is appended (64 x 256 slots: ~130 KB of lists)
    SCANS = 16  # places found by scanning the decode set before a map of it is built

    def __init__(self) -> None:
        # Per step recorded and not yet appended to every request, the slot of each of `_reqs` (what
        # `Req.kv_indices` looks at first).
        self.pending: list[list[int]] = []
        self._reqs: list[Req] = []  # the decode set the pending steps were for, in their order
        self._lens: list[int] = []  # each of `_reqs`' KV length after the newest step
        self._done: dict[int, int] = {}  # place -> pending steps already appended to that request
        self._scans = 0  # places looked up in this decode set so far
        self._places: dict[int, int] | None = None  # id(req) -> place, once lookups are many

    def record(self, reqs: list[Req], slots: list[int]) -> list[int]:
        """Give each request its slot of this decode step; returns their KV lengths after it. The first
        step of a decode set appends at once (one pass over the requests, as every step did before the
        log); the next steps of the same set (a list comparison each) are logged."""
        assert len(slots) == len(reqs), "a step's slots are one per request of the decode set"
        if reqs != self._reqs:
            self.clear()
            self._reqs = list(reqs)
            lens = self._lens = []
            for r, slot in zip(reqs, slots, strict=True):
                if r.kv_log is not self:
                    r.kv_log = self
                kv = r._kv_indices  # nothing is pending here after the clear
                kv.append(slot)
                lens.append(len(kv))
            return lens
        if len(self.pending) >= self.MAX_PENDING:
            self.flush()
        self.pending.append(slots)
        self._lens = [n + 1 for n in self._lens]
        return self._lens

    def append_pending(self, req: Req) -> None:
        """Append the steps pending for `req` (none if it is not in the decode set) to its list."""
        i = self._place(req)
        if i is None:
            return
        done, steps = self._done.get(i, 0), self.pending
        if done < len(steps):
            req._kv_indices.extend([step[i] for step in steps[done:]])
            self._done[i] = len(steps)

    def replaced(self, req: Req, kv_indices: list[int]) -> None:
        """`req`'s list was replaced (after `append_pending`): its length in the set follows the new one."""
        i = self._place(req)
        if i is not None:
            self._lens = list(self._lens)  # a step's batch may hold the old list
            self._lens[i] = len(kv_indices)

    def flush(self) -> None:
        """Append every pending step to every request of the decode set."""
        if not self.pending:
            return
        done = self._done
        for i, (r, slots) in enumerate(zip(self._reqs, zip(*self.pending, strict=True), strict=True)):
            r._kv_indices.extend(slots[done.get(i, 0) :])
        self.pending = []
        self._done = {}

    def clear(self) -> None:
        """Append everything and forget the decode set (the next step starts a new one)."""
        self.flush()
        self._reqs, self._lens, self._scans, self._places = [], [], 0, None

    def check(self) -> None:
        """The lengths the next step continues from are the lists' (the log's invariant: nothing
        changes the length of a list in the decode set but a step or a replacement through the setter)."""
        actual = [len(r.kv_indices) for r in self._reqs]
        assert actual == self._lens, f"decode KV lengths {self._lens} differ from the lists' {actual}"

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
