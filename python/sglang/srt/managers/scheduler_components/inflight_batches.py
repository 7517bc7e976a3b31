"""`InflightBatches`: the batches built and not yet processed, in launch order, and what they mean for
each request: which batches in flight contain it, how many tokens they will sample for it, and the
placeholder (SGLang's future map) that names its newest token while that token is in flight.

A request's in-flight state is read from here instead of being counted on the request: every decode
step puts every running request into a batch and takes it out when the result is processed, and
counters on each request, written at both ends, were a whole pass over the requests' objects per step
(a sizeable share of the scheduler's host time per decode step with hundreds running; timings:
benchmark/README.md). The questions are asked rarely (a request that finishes, is retracted or first qualifies
for decode, and the decode build when the batch differs from the newest one in flight) and are
answered from the few batches in flight (at most two under overlap).

A batch counts as in flight from its build (`add`, which also gives it its future slots) to the
processing of its result (`landed`, before any of its rows is processed).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from sglang.srt.model_executor.forward_worker import placeholders

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch


class FutureSlots:
    """Slots of the overlap schedule's future-token map (SGLang's future map), handed out in a ring: a
    batch's sampled token goes to its slot, and a later batch names it by placeholder until processed."""

    def __init__(self, size: int):
        self.size = size
        self.cursor = 0

    def alloc(self, n: int) -> Sequence[int]:
        """`n` slots in order: a `range` unless the ring wraps (every batch asks, so no list)."""
        start, size = self.cursor, self.size
        self.cursor = (start + n) % size
        if start + n <= size:
            return range(start, start + n)
        return [(start + i) % size for i in range(n)]


class _Entry:
    __slots__ = ("batch", "_rows")

    def __init__(self, batch: ScheduleBatch):
        self.batch = batch
        self._rows: dict[Req, int] | None = None

    @property
    def rows(self) -> dict[Req, int]:
        """Row of each request in the batch, made when first asked."""
        if self._rows is None:
            self._rows = {req: i for i, req in enumerate(self.batch.reqs)}
        return self._rows


class InflightBatches:
    def __init__(self, future_size: int):
        self.future_slots = FutureSlots(future_size)
        self._entries: deque[_Entry] = deque()
        # The newest decode batch whose result was processed, and its sampled tokens (now its
        # requests' newest outputs): the input of the next decode of the same requests.
        self._landed: tuple[list[Req], Sequence[int]] | None = None

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, batch: ScheduleBatch) -> None:
        """A batch was built (its `sample_rows` set): it takes its future slots and is in flight."""
        batch.future_slots = self.future_slots.alloc(batch.batch_size)
        self._entries.append(_Entry(batch))

    def landed(self, batch: ScheduleBatch, sampled: Sequence[int]) -> None:
        """The result of the oldest batch, `sampled` its tokens, is about to be processed: it is no
        longer in flight."""
        assert self._entries[0].batch is batch, "batches are processed in the order they were built"
        self._entries.popleft()
        # Processing a decode result appends each row's token to its request's outputs (a request
        # finished before is skipped, and one that finishes on it does not decode again).
        self._landed = (batch.reqs, sampled) if batch.forward_mode.is_decode() else None

    def num_inflight(self, req: Req) -> int:
        """Batches in flight that contain `req`."""
        return sum(req in e.rows for e in self._entries)

    def inflight_tokens(self, req: Req) -> int:
        """Tokens the batches in flight will sample for `req`."""
        n = 0
        for e in self._entries:
            row = e.rows.get(req)
            n += row is not None and e.batch.sample_rows[row]
        return n

    def steady_decode_input_ids(self, reqs: list[Req]) -> tuple[Sequence[int], bool] | None:
        """`decode_input_ids` in the steady decode step, which reads no request: the previous decode of
        the same requests, in the same order, was the newest batch. None otherwise (the caller makes
        the requests' `output_ids` current first, then asks `decode_input_ids`)."""
        entries = self._entries
        if not entries:
            landed = self._landed
            if landed is not None and landed[0] == reqs:
                # Without overlap: its tokens are the previous step's.
                return landed[1], False
            return None
        newest = entries[-1].batch
        if newest.reqs == reqs and all(newest.sample_rows):
            # Under overlap: the previous decode is in flight, and newer than any other batch.
            return placeholders(newest.future_slots), True
        return None

    def decode_input_ids(self, reqs: list[Req]) -> tuple[Sequence[int], bool]:
        """Each request's newest token, the input of its decode step: the placeholder of the newest
        batch in flight that samples it, else its newest output token. Returns (ids, whether any is a
        placeholder). Call it before `add` of the batch being built."""
        steady = self.steady_decode_input_ids(reqs)
        if steady is not None:
            return steady
        refs: dict[Req, int] = {}
        for e in self._entries:  # oldest first: a newer batch's placeholder replaces an older one's
            batch = e.batch
            for req, slot, sampled in zip(batch.reqs, batch.future_slots, batch.sample_rows, strict=True):
                if sampled:
                    refs[req] = ~slot
        if not refs:
            return [r.output_ids[-1] for r in reqs], False
        ids = [refs[r] if r in refs else r.output_ids[-1] for r in reqs]
        return ids, min(ids) < 0  # placeholders are negative, tokens are not
