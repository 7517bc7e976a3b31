"""Priority scheduling's flags (upstream's names and defaults; the rule: `managers/scheduler_components/
priority_scheduling.py`): their command line and start-time checks, each refusal one sentence naming the
flag."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang.srt.server_args_checks import ServerArgsError

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)
# A request's (and the default) priority: an integer within this bound either way.
PRIORITY_BOUND = 1 << 62
# The schedule policies priority scheduling orders within, as upstream's.
PRIORITY_POLICIES = ("fcfs", "lof")


@dataclass
class PriorityArgs:
    """ServerArgs' priority-scheduling fields (a base class, so `server_args.py` stays small)."""

    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    disable_priority_preemption: bool = False
    default_priority_value: int | None = None
    abort_on_priority_when_disabled: bool = False


def add_priority_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("priority scheduling", "A request's priority field: docs/server.md.")
    g.add_argument(
        "--enable-priority-scheduling",
        action="store_true",
        help="Order the waiting requests by their priority (higher values first), then by the schedule "
        "policy (fcfs or lof); a waiting request may preempt running ones it outranks.",
    )
    g.add_argument(
        "--schedule-low-priority-values-first", action="store_true", help="Lower priority values first."
    )
    g.add_argument(
        "--priority-scheduling-preemption-threshold",
        type=int,
        default=10,
        help="A waiting request preempts a running one only if its priority is better by more than this.",
    )
    g.add_argument("--disable-priority-preemption", action="store_true", help="Order only; never preempt.")
    g.add_argument(
        "--default-priority-value",
        type=int,
        default=None,
        help="The priority of a request that names none (default: below every other).",
    )
    g.add_argument(
        "--abort-on-priority-when-disabled",
        action="store_true",
        help="Without priority scheduling, end a request that names a priority with 503 (else it is ignored).",
    )


def check_priority_flags(args: ServerArgs) -> None:
    if not args.enable_priority_scheduling:
        for flag, value in (("--default-priority-value", args.default_priority_value is not None),
                            ("--disable-priority-preemption", args.disable_priority_preemption),
                            ("--schedule-low-priority-values-first", args.schedule_low_priority_values_first)):  # fmt: skip
            if value:
                logger.warning("%s has no effect without --enable-priority-scheduling.", flag)
        return
    if args.schedule_policy not in PRIORITY_POLICIES:
        raise ServerArgsError(
            f"--enable-priority-scheduling orders within --schedule-policy fcfs or lof, as upstream's; not "
            f"{args.schedule_policy}."
        )
    if args.priority_scheduling_preemption_threshold < 0:
        raise ServerArgsError(
            "--priority-scheduling-preemption-threshold must be at least 0 (requests of equal priority would "
            "preempt each other)."
        )
    if args.default_priority_value is not None and abs(args.default_priority_value) >= PRIORITY_BOUND:
        raise ServerArgsError("--default-priority-value must be within +-2**62.")
