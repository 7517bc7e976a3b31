"""`OutputCheckBudget`: what the per-token checks of requests' outputs may cost the scheduler thread. Those
checks are a grammar's token accept and mask fill (xgrammar), a stop_regex search of the output's
tail, and the stop strings' scan of a request with more or longer ones than most clients send
(`stop_strings.py`): they run on the scheduler thread between two forwards, so what they take, every
running request waits for. The rule, all of it here:

- One request's checks for one token (its mask fill, its accept, its stop_regex search) may take at most
  its *allowance*: SGLANG_OUTPUT_CHECK_BUDGET_PER_REQ, and no more than what the step's budget
  (SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP) leaves beside the other requests' latest costs, though always
  a fair share of it (the step's budget over the requests with checks). A batch's checks are measured
  together before any of them is charged (`FinishChecker.precheck`: under tensor parallelism the ranks
  agree on a batch's costs at once): a request's allowance is then the one it had when it was measured,
  with the costs the batch's rows measured before it counted as charged (`PendingCharges`; the ranks
  take the smallest of their allowances), but not the requests those charges will end. A speculative
  verify's tokens after a request's first are measured with the batch too, after every request's first
  token, each given only what the step's budget has left beside the load and all the step's cost rises
  (its request's earlier tokens' included; no fair share: its request had one; a first token's cost drop
  is no room, as the commit charges the rows in turn: `PendingCharges.rise`), not measured nor committed
  where that would not cover its request's latest cost, and its request commits nothing after one that
  went over it (`FinishChecker.verify_tokens`; that overrun is no strike): a verify step's checks take
  what a decode step's of the same requests may, or the step's budget, not the draft width times that.
- The *load* is the sum of every live request's latest per-token cost: what one step of them all
  costs (a step gives each running request one token; NGRAM's verify up to its draft width). When a
  request's cost takes the load over the step's budget, the costliest requests are ended until it
  fits: cheap requests are never ended for costly ones. Requests that start together are known to the
  load only once checked, each after at least its fair share: a step where n start at once may spend
  up to 1 + ln(n) budgets, once.
- A request over its allowance for two tokens in a row (or for one token by more than `SPIKE` times),
  or ended for the load, ends with a 400 naming the field that cost it the most (`ebnf`, `json_schema`,
  `regex`, `structural_tag`, `stop_regex` or `stop`); one ended for the load ends at its next check, and its
  grammar fills no more masks meanwhile. One token's overrun alone may be the machine's (the thread
  descheduled in the middle of a sub-millisecond call on a loaded host), and must not end a request.
  (The load counts each request's latest cost as it is: a lagging one would let costs that grow token
  by token take steps over the budget.)

A stop_regex search is cut at the request's allowance (the `regex` module's timeout); xgrammar's calls
cannot be interrupted, so a grammar's cost is measured after each call: a grammar whose cost grows
token by token (an ambiguous EBNF) overruns its allowance by at most one call before it ends. Costs are
wall time, what the other requests wait: xgrammar's fill works on threads of its own too (the calling
thread's CPU time showed an eighth of a slow fill's).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING

from sglang.srt.environ import envs

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

clock = time.perf_counter
# Seconds two budget figures may differ by and still count as equal (float sums' drift: far below any
# check's measured cost).
DRIFT_S = 1e-9
# One token's checks over this many allowances end a request at once (no second token is waited for).
SPIKE = 10


class OutputCheckBudget:
    def __init__(self, per_request_s: float | None = None, per_step_s: float | None = None):
        if per_request_s is None:
            per_request_s = envs.SGLANG_OUTPUT_CHECK_BUDGET_PER_REQ.get()
        if per_step_s is None:
            per_step_s = envs.SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP.get()
        # (0 or less: no limit, as the request deadlines)
        self.per_request_s = per_request_s if per_request_s > 0 else math.inf
        self.per_step_s = per_step_s if per_step_s > 0 else math.inf
        # Each live request's latest per-token cost and the field that cost the most (identity keys).
        self._cost: dict[Req, tuple[float, str]] = {}
        self._over: set[Req] = set()  # requests whose latest token's checks went over their allowance
        self._load = 0.0
        self._ended: dict[Req, str] = {}  # request -> why: ended for the load, at its next check
        self._pruned_at = 0  # entries after the last pruning

    @property
    def load(self) -> float:
        return self._load

    def allowance(self, req: Req, pending: PendingCharges | None = None, later: bool = False) -> float:
        """What `req`'s checks for its next token may take (`pending`: the costs a batch measured before
        it, not charged yet, counted as charged). `later`: a token after `req`'s first in the same step
        (a verify's accepted drafts and bonus token, measured with `pending`): it replaces no cost of
        `req`'s and is owed no fair share (its request had one for its first token), so it may take what
        the step's budget has left beside all the step's costs, `req`'s earlier tokens' included (0 or
        less: nothing; `FinishChecker.verify_tokens` then commits it not)."""
        own = self._cost.get(req)
        n = len(self._cost) + (own is None)
        load = self._load
        if pending is not None:
            n += pending.added
            if later:  # (a first token's cost drop is no room: its row may be charged after this token)
                return min(self.per_request_s, self.per_step_s - (load + pending.rise))
            load += pending.delta
        step = self.per_step_s
        if later:
            return min(self.per_request_s, step - load)
        others = load if own is None else load - own[0]
        return min(self.per_request_s, max(step - others, step / n))

    def cost(self, req: Req) -> float:
        """`req`'s latest per-token cost (0 before its first charge)."""
        entry = self._cost.get(req)
        return 0.0 if entry is None else entry[0]

    def is_ended(self, req: Req) -> bool:
        """Whether `req` was ended for the load (`ended`, without forgetting it)."""
        return req in self._ended

    def ended(self, req: Req) -> str | None:
        """Why `req` was ended for the load (it is forgotten), or None."""
        return self._ended.pop(req, None)

    def over_allowance(self, req: Req, cost: float, allowance: float) -> bool:
        """Whether `req` ends for a token's checks that took `cost` seconds past its `allowance`: the
        second token in a row over it, or one over it `SPIKE` times. Else the overrun is remembered."""
        if cost > SPIKE * allowance or req in self._over:
            return True
        self._over.add(req)
        return False

    def charge(self, req: Req, cost: float, field: str, over: bool = False) -> None:
        """`req`'s checks for one token took `cost` seconds, `field` the costliest part, `over` its
        allowance or not. If that takes the load over the step's budget, the costliest requests (maybe
        `req`) are ended."""
        if not over:
            self._over.discard(req)
        self._load += cost - self._cost.get(req, (0.0, ""))[0]
        self._cost[req] = (cost, field)
        if len(self._cost) + len(self._ended) > 2 * self._pruned_at + 64:
            self._prune()
        if self._load <= self.per_step_s:
            return
        self._prune()
        for victim, (spent, why) in sorted(self._cost.items(), key=lambda e: e[1][0], reverse=True):
            if self._load <= self.per_step_s:
                break
            self._load -= spent
            del self._cost[victim]
            self._ended[victim] = why
            if victim.grammar is not None:
                victim.grammar.stopped = True  # no more mask fills: it ends at its next check

    def forget(self, req: Req) -> None:
        """`req` finished: it costs nothing any more."""
        entry = self._cost.pop(req, None)
        if entry is not None:
            self._load -= entry[0]
        self._ended.pop(req, None)
        self._over.discard(req)

    def _prune(self) -> None:
        """Forget requests that ended elsewhere (aborted, refused) since their last check."""
        self._cost = {r: c for r, c in self._cost.items() if r.finished_reason is None}
        self._ended = {r: f for r, f in self._ended.items() if r.finished_reason is None}
        self._over = {r for r in self._over if r.finished_reason is None}
        self._load = sum(c for c, _ in self._cost.values())  # (also drops the float sums' drift)
        self._pruned_at = len(self._cost) + len(self._ended)

    def over_load_message(self, field: str) -> str:
        return (
            f"{field} was among the costliest checks when the requests' grammar, stop and stop_regex "
            f"work took more than the scheduler's {self.per_step_s * 1e3:g} ms per step "
            f"(SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP); use a simpler {_what(field)}."
        )

    def over_allowance_message(self, field: str, cost: float, allowance: float) -> str:
        return (
            f"{field} took {cost * 1e3:.0f} ms of the scheduler's time for one token, more than the "
            f"{allowance * 1e3:.0f} ms a request may take (SGLANG_OUTPUT_CHECK_BUDGET_PER_REQ, within "
            f"SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP for all requests); use a simpler {_what(field)}."
        )


class PendingCharges:
    """The costs of a batch's checks measured so far, each to be charged once the batch is decided
    (`FinishChecker.precheck`): what they add to the load, and the requests new to it."""

    def __init__(self, budget: OutputCheckBudget):
        self.budget = budget
        self.delta = 0.0
        # What they may add to the load at most while they are charged in row order: the first tokens'
        # rises (not their drops: a later row's drop may be charged after an earlier row's later token)
        # and the later tokens' costs. A later token is given only what the step has left beside it.
        self.rise = 0.0
        self.added = 0

    def add(self, req: Req, cost: float, later: bool = False) -> None:
        """`req`'s check of a token cost `cost` (`later`: a token after its first in the step, which adds
        to the load instead of replacing the request's latest cost)."""
        if later:
            self.delta += cost
            self.rise += cost
            return
        old = self.budget._cost.get(req)
        change = cost - (0.0 if old is None else old[0])
        self.delta += change
        self.rise += max(change, 0.0)
        self.added += old is None


def _what(field: str) -> str:
    if field == "stop":
        return "list of stop strings (fewer or shorter ones)"
    return "pattern" if field in ("stop_regex", "regex") else "grammar"
