"""The scheduler's measuring calls, a part of the `Scheduler` class kept in its own file (upstream's
`scheduler_profiler_mixin.py`): /start_profile and /stop_profile (`scheduler_profiler.py`) and the
expert distribution recorder's start, stop and dump (`model_executor/expert_distribution.py`). Each runs
on every TP rank (the same messages); it does not import `scheduler.py`."""

from __future__ import annotations

from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import ExpertDistributionReqOutput, ProfileReq, ProfileReqOutput
from sglang.srt.managers.scheduler_components.scheduler_profiler import SchedulerProfiler
from sglang.srt.managers.scheduler_components.scheduler_watchdog import wait_forward


class SchedulerProfilerMixin:
    def profile(self, req: ProfileReq) -> ProfileReqOutput:
        """/start_profile and /stop_profile on this rank (every rank runs them: each writes its trace)."""
        if self.profiler is None:
            tp_rank = self.tp.rank.tp_rank if self.tp is not None else 0
            max_steps = envs.SGLANG_PROFILE_MAX_STEPS.get()
            self.profiler = SchedulerProfiler(tp_rank, self.dp_rank, max_steps, self._wait_in_flight)
        out = self.profiler.handle(req, self.num_batches)
        if self.tp is not None:  # (a rank that could not start or write says so, whichever rank answers)
            error = self.tp.agree_outcome(None if out.success else out.message, "none of them profiles")
            if error is not None and out.success and req.type == "start":
                self.profiler.abandon()  # (the ranks stay alike: a retry starts on every rank)
            out = ProfileReqOutput(error is None, error or out.message)
        return out

    def expert_distribution(self, action: str) -> ExpertDistributionReqOutput:
        """The expert distribution recorder's start, stop or dump (`model_executor/expert_distribution.py`)."""
        capture = self.model_runner.routed_experts
        if capture is None or capture.distribution is None:
            refusal = "Start the server with --expert-distribution-recorder-mode stat to record the expert distribution."
            return ExpertDistributionReqOutput(False, refusal)
        self._wait_in_flight()  # (a forward on the forward thread may be adding to it)
        writes = self.tp is None or self.tp.is_first
        return ExpertDistributionReqOutput(*capture.distribution.handle(action, writes, self.dp_rank))

    def _wait_in_flight(self) -> None:
        """Until the batches launched so far have run (not processed), within --watchdog-timeout each."""
        for batch, fut in self.in_flight:
            wait_forward(batch, fut, self.watchdog_timeout)
