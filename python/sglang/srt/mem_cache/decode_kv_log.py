"""`DecodeKVLog`: the KV slots that decode steps give an unchanged list of requests, kept per step and
appended to each request's `kv_indices` only when something reads that list (`DecodeStepLog`, whose
module says why: at 256 requests the per-request append was a quarter of a steady step's host time).
While the decode set is unchanged each request's KV length follows from the previous step's (+1 each).

Nothing reads a request's list in a steady step; what does (a finish, a retraction, a snapshot insert at a
track boundary, a dirty-row rewrite, the integrity checks) goes through `Req.kv_indices`, which first
appends the steps pending for that request. The whole log is appended when the decode set changes (the
new set's first step is appended at once, in the pass that reads the lengths), and every `MAX_PENDING`
steps, which bounds its memory.

Used for page size 1 only (`alloc_for_decode`): with larger pages a step's slot depends on each request's
last slot, which a snapshot insert may have replaced in its list.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sglang.srt.managers.decode_step_log import DecodeStepLog

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


class DecodeKVLog(DecodeStepLog):
    LIST_ATTR = "_kv_indices"

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

    def replaced(self, req: Req, kv_indices: list[int]) -> None:
        """`req`'s list was replaced (after `append_pending`): its length in the set follows the new one."""
        i = self._place(req)
        if i is not None:
            self._lens = list(self._lens)  # a step's batch may hold the old list
            self._lens[i] = len(kv_indices)

    def clear(self) -> None:
        super().clear()
        self._lens = []

    def check(self) -> None:
        """The lengths the next step continues from are the lists' (the log's invariant: nothing
        changes the length of a list in the decode set but a step or a replacement through the setter)."""
        actual = [len(r.kv_indices) for r in self._reqs]
        assert actual == self._lens, f"decode KV lengths {self._lens} differ from the lists' {actual}"
