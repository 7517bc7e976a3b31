"""`DecodeTokenLog`: the tokens of decode steps that can end no request, kept per step and committed to
each request's `output_ids` at the next boundary that reads the lists (`DecodeStepLog` says why). The
log only holds them: committing them is the commit path's (`batch_result_processor.commit_logged`, which
`DecodeFastPath.flush` and the decode result loop call), so that `output_ids` grows in one module.

A step's tokens are logged instead of committed one by one (`log`) when all of these hold:
- the batch is the decode set the log was started for (the same requests in the same order);
- no request can reach the output length at which its finish check runs (`Req.finish_check_len`): the
  smallest distance to it, taken when the log started, stays above the steps since (`_slack`);
- no token of the step is a stop or end-of-sequence id of any request of the set (`_stop_ids`, their
  union; one C-level `isdisjoint`);
- fewer than `MAX_PENDING` steps wait (the bound on the log's memory: the step is committed one by one
  after the pending ones).
Then no request can finish on the step: its tokens need no other bookkeeping.

The caller commits every other step one by one (after committing the pending ones) and tells the log
(`after_step`): a step in which a request of the batch finished or was already gone forgets the set; the
same batch twice in a row starts logging it. Whatever ends a request outside a step (an abort, a PD
hand-off, a retraction) forgets the set too (`DecodeFastPath.clear`), so a request that is gone never
gets a logged token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from sglang.srt.managers.decode_step_log import DecodeStepLog

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


class DecodeTokenLog(DecodeStepLog):
    def __init__(self, enabled: bool = True) -> None:
        super().__init__(enabled)
        self._steps = 0  # steps of the set since the log started it
        self._slack = 0  # a step numbered this (or later) may reach some request's finish check length
        self._stop_ids: frozenset[int] = frozenset()
        self._base: list[int] = []  # each of `_reqs`' output length when the log started the set
        self._previous: list[Req] | None = None  # the last batch committed one by one
        self.steps_logged = 0  # (tests and benchmarks)

    def log(self, reqs: list[Req], tokens: Sequence[int]) -> bool:
        """Log this step's tokens for `reqs` (True) if no request can finish on them; else False: the
        caller commits the pending steps, then this one token by token, and then calls `after_step`."""
        if (
            self._steps + 1 >= self._slack
            or reqs != self._reqs
            or not self._stop_ids.isdisjoint(tokens)
            or len(self.pending) >= self.MAX_PENDING
            or not self.enabled
        ):
            return False
        self.pending.append(tokens)
        self._steps += 1
        self.steps_logged += 1
        return True

    def after_step(self, reqs: list[Req], clean: bool) -> None:
        """A step of `reqs` was committed one by one; `clean`: no request of it finished or was gone."""
        if not clean:
            self.clear()
        elif self._reqs and reqs == self._reqs:
            self._steps += 1
        elif reqs == self._previous:
            self._start(reqs)
        else:
            self.clear()
            self._previous = list(reqs)

    def _start(self, reqs: list[Req]) -> None:
        self.clear()
        stop_ids, base, slack = set(), [], []
        for r in reqs:
            if r.finish_token_ids is None:
                return  # no quick check yet: every step checks it
            n = len(r.output_ids)
            base.append(n)
            slack.append(r.finish_check_len - n)
            stop_ids |= r.finish_token_ids
        self._reqs, self._base, self._stop_ids = list(reqs), base, frozenset(stop_ids)
        self._slack = min(slack, default=0)

    def check(self) -> None:
        """The log's invariant: nothing but the set's steps (logged or committed) added tokens to its
        requests since it started the set (the slack counts on it)."""
        actual = [len(r.output_ids) + n for r, n in zip(self._reqs, self.lacking(), strict=True)]
        expected = [n + self._steps for n in self._base]
        assert actual == expected, f"decode output lengths {actual} differ from the log's {expected}"

    def clear(self) -> None:
        """Forget the decode set. Its pending steps must have been committed (`commit_logged`): the log
        cannot commit them itself."""
        self.forget()
        self._steps, self._slack, self._previous, self._base = 0, 0, None, []
