"""`DecodeKVLog`: the KV slots that decode steps give an unchanged list of requests, kept per step and
appended to each request's `kv_indices` at the next boundary that reads the lists (`DecodeStepLog`, whose
module says why: at 256 requests the per-request append was a quarter of a steady step's host time).
While the decode set is unchanged each request's KV length follows from the previous step's (+1 each).

Nothing reads a request's list in a steady step. What does (a finish's release, a retraction, a dirty-row
rewrite, a speculative verify's allocation, the integrity check) comes after the scheduler's
`DecodeFastPath.flush`; a decode set that changes appends everything first (`clear`; the new set's first
step is appended at once, in the pass that reads the lengths), and so does every `MAX_PENDING`-th step,
which bounds the log's memory.

Used for page size 1 only (`alloc_for_decode`): with larger pages a step's slot depends on each request's
last slot, which a snapshot insert may have replaced in its list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.managers.decode_step_log import DecodeStepLog

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


class DecodeKVLog(DecodeStepLog):
    def __init__(self, enabled: bool = True) -> None:
        super().__init__(enabled)
        self._lens: list[int] = []  # each of `_reqs`' KV length after the newest step

    def record(self, reqs: list[Req], slots: list[int]) -> list[int]:
        """Give each request its slot of this decode step; returns their KV lengths after it. The first
        step of a decode set appends at once (one pass over the requests, as every step did before the
        log); the next steps of the same set (a list comparison each) are logged."""
        assert len(slots) == len(reqs), "a step's slots are one per request of the decode set"
        if reqs != self._reqs or not self.enabled:
            self.clear()
            self._reqs = list(reqs)
            lens = self._lens = []
            for r, slot in zip(reqs, slots, strict=True):
                kv = r.kv_indices  # nothing is pending here after the clear
                kv.append(slot)
                lens.append(len(kv))
            return lens
        if len(self.pending) >= self.MAX_PENDING:
            self.flush()
        self.pending.append(slots)
        self._lens = [n + 1 for n in self._lens]  # (a new list: a step's batch holds the old one)
        return self._lens

    def flush(self, req: Req | None = None) -> None:
        """Append the pending steps' slots to the requests' lists (`req`'s alone, if given: a snapshot
        insert of one request while the others go on)."""
        for r, slots in self.take(req):
            r.kv_indices.extend(slots)

    def clear(self) -> None:
        """`flush`, and forget the decode set (the next step starts a new one)."""
        self.flush()
        self.forget()
        self._lens = []

    def check(self) -> None:
        """The lengths the next step continues from are the lists' with the pending steps (the log's
        invariant: nothing changes the length of a list in the decode set but a step, unless the set is
        forgotten first, as a release or a retraction does)."""
        actual = [len(r.kv_indices) + n for r, n in zip(self._reqs, self.lacking(), strict=True)]
        assert actual == self._lens, f"decode KV lengths {self._lens} differ from the lists' {actual}"
