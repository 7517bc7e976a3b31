"""Priority scheduling (upstream's `--enable-priority-scheduling`): a request's `priority` orders the
waiting queue, and a waiting request that outranks running ones by more than the threshold preempts them
when it finds no room.

- Order: by priority (higher values first; `--schedule-low-priority-values-first`: lower first), then in
  the `--schedule-policy` order (fcfs: arrival; lof: the largest max_new_tokens). A request without a
  priority gets `--default-priority-value`, else the lowest there is.
- Preemption (unless `--disable-priority-preemption`; not under PD disaggregation, where a decode server
  cannot prefill a request again): when the most preferred waiting request cannot be admitted for want of
  a request slot (`--max-running-requests`, the pools' rows) or of KV room for its first chunk, running
  requests it outranks by more than `--priority-scheduling-preemption-threshold` (default 10) are
  retracted, the least preferred first (the newest among equals), until it fits or none is left. A
  retracted request gives back its KV and state slot and prefills again later (its prefix from the radix
  cache where it is still there), as one retracted under memory pressure does: its greedy output is the
  same.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sglang.srt.managers.req import Req

# A request's priority is an integer within +-2^62 (checked where it comes in: `request_validation`);
# these stand for "none": below (or above) any of them.
LOWEST, HIGHEST = -(1 << 63), 1 << 63


@dataclass(frozen=True)
class PriorityRule:
    low_values_first: bool = False
    default: int | None = None
    threshold: int = 10
    preemption: bool = True

    @classmethod
    def of(cls, args) -> PriorityRule | None:
        """The rule of --enable-priority-scheduling and its flags; None without it."""
        if not args.enable_priority_scheduling:
            return None
        return cls(
            args.schedule_low_priority_values_first,
            args.default_priority_value,
            args.priority_scheduling_preemption_threshold,
            not args.disable_priority_preemption and args.disaggregation_mode == "null",
        )

    def value(self, priority: int | None) -> int:
        """A request's priority, the default (or the least preferred value) for none."""
        if priority is None:
            priority = self.default
        if priority is None:
            return HIGHEST if self.low_values_first else LOWEST
        return priority

    def key(self, req: Req) -> int:
        """Sort key: smaller is preferred."""
        v = self.value(req.priority)
        return v if self.low_values_first else -v

    def order(self, reqs: list[Req]) -> list[Req]:
        """`reqs` (in the schedule policy's order) by priority, the policy's order kept among equals."""
        return sorted(reqs, key=self.key)

    def outranks(self, req: Req, other: Req) -> bool:
        """Whether `req` may preempt `other`: preferred by more than the threshold."""
        return self.key(other) - self.key(req) > self.threshold


def preemption_victims(
    rule: PriorityRule | None, waiting: list[Req], running: list[Req], lacks_room: Callable[[Req], bool]
) -> tuple[Req | None, list[Req]]:
    """(the most preferred waiting request, the running requests it may preempt, least preferred first),
    or (None, []) where nothing is to be preempted: no rule, no preemption, nothing waiting, or room for it
    already (`lacks_room(best)` False). The caller retracts victims one at a time while `lacks_room`."""
    if rule is None or not rule.preemption or not waiting:
        return None, []
    best = min(waiting, key=rule.key)  # (the first of the most preferred, in queue order)
    # (the victims first: where there are none, as under a steady load of equals, the room is not looked
    # at, which matches the best request's prompt in the radix tree at every step it waits)
    victims = [r for r in running if rule.outranks(best, r)]
    if not victims or not lacks_room(best):
        return None, []
    # Least preferred first; among equals the newest (it has run least).
    victims.sort(key=lambda r: (rule.key(r), r.created_time), reverse=True)
    return best, victims


QUEUE_FULL = "The request queue is full."
OUTRANKED_IN_QUEUE = "The request is aborted by a higher priority request."
PRIORITY_DISABLED = "Using priority is disabled for this server. Please send a new request without a priority."


def queue_overflow(limit: int | None, rule: PriorityRule | None, waiting: list[Req], req: Req) -> Req | None:
    """--max-queued-requests (`limit`; None: no bound): which request ends with 503 as `req` comes to a
    queue of `limit` waiting requests: `req` itself, or with priority scheduling the least preferred
    waiting one (the newest among equals) where `req` is preferred to it (upstream's rule); None while
    the queue has room. The same on every TP rank (their queues are the same)."""
    if limit is None or len(waiting) < limit:
        return None
    if rule is None:
        return req
    worst = max(reversed(waiting), key=rule.key)  # (the newest of the least preferred)
    return worst if rule.key(req) < rule.key(worst) else req
