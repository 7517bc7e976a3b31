"""The messages of the measuring and upkeep calls (/start_profile, /stop_profile, the expert distribution
recorder, /freeze_gc): the TokenizerManager's call to every scheduler and its reply. `io_struct`
re-exports them under upstream's module name."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProfileReq:
    """/start_profile (`type` "start") or /stop_profile ("stop"), checked by `profile_request`: the
    scheduler's torch profiler (`scheduler_profiler.py`). `output_dir` is absolute."""

    type: str = "start"
    output_dir: str = ""
    start_step: int | None = None
    num_steps: int | None = None
    activities: tuple[str, ...] = ("CPU", "GPU")
    with_stack: bool = True
    record_shapes: bool = False
    profile_by_stage: bool = False
    stages: tuple[str, ...] = ("EXTEND", "DECODE")  # those traced with profile_by_stage
    profile_id: str = ""
    profile_prefix: str | None = None

    @property
    def file_prefix(self) -> str:
        return f"{self.profile_prefix}-" if self.profile_prefix else ""


@dataclass
class ProfileReqOutput:
    success: bool
    message: str


@dataclass
class FreezeGCReq:
    """/freeze_gc: every process moves what it holds now out of the cyclic collector's reach."""


@dataclass
class FreezeGCReqOutput:
    success: bool
    message: str


@dataclass
class ExpertDistributionReq:
    """/start_expert_distribution_record ("start"), /stop_... ("stop") or /dump_... ("dump")."""

    action: str


@dataclass
class ExpertDistributionReqOutput:
    success: bool
    message: str
