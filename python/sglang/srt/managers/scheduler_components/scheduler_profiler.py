"""The scheduler's torch profiler (upstream's /start_profile and /stop_profile, `Engine.start_profile`).

One `SchedulerProfiler` per scheduler process (every TP rank runs the same messages, so each rank
traces its own forwards and writes its own file). A profile starts when its request arrives, or with
`start_step` before that batch (the scheduler's batch count); with `num_steps` it stops itself after
that many batches, else at /stop_profile, and at the latest after `SGLANG_PROFILE_MAX_STEPS` batches
(a trace grows in memory with every step; upstream has no such bound). With `profile_by_stage` it
traces the next `num_steps` prefill batches and the next `num_steps` decode batches into two files
(`profile_stages`: one of them only).

Traces are Chrome traces: `<output_dir>/[<profile_prefix>-]<profile_id>-TP-<rank>[-DP-<rank>][-<STAGE>]
.trace.json.gz` (open them in Perfetto or chrome://tracing). Every thread is traced (the overlap
schedule's forward thread too). `MEM` (a CUDA memory snapshot, `.pickle`) and `CUDA_PROFILER` (for
`nsys --capture-range=cudaProfilerApi`) need CUDA; `GPU` on a CPU server traces nothing more.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch

from sglang.srt.managers.io_struct import ProfileReq, ProfileReqOutput

logger = logging.getLogger(__name__)


class SchedulerProfiler:
    def __init__(self, tp_rank: int, dp_rank: int | None, max_steps: int):
        self.label = f"TP-{tp_rank}" + ("" if dp_rank is None else f"-DP-{dp_rank}")
        self.max_steps = max_steps
        self.req: ProfileReq | None = None  # the profile asked for, from its start until it ends
        self.profiler: Any = None  # the torch profiler while one runs (None for MEM / CUDA_PROFILER only)
        self.started = False  # tracing now
        self.stage: str | None = None  # "EXTEND" or "DECODE" while a by-stage profile traces one
        self.start_at: int | None = None  # the batch a profile with start_step starts before
        self.steps = 0  # batches traced by the running profiler (by stage: of its stage)
        self.stages_done: set[str] = set()
        self.written: list[str] = []  # the files of the last profile

    @property
    def active(self) -> bool:
        return self.req is not None

    # ---- the requests ------------------------------------------------------------------------------

    def handle(self, req: ProfileReq, batches_run: int) -> ProfileReqOutput:
        if req.type == "stop":
            if self.req is None:
                return ProfileReqOutput(False, "Profiling is not in progress. Call /start_profile first.")
            return self._end()
        if self.req is not None:
            return ProfileReqOutput(False, "Profiling is already in progress. Call /stop_profile first.")
        self.req, self.steps, self.stages_done, self.written = req, 0, set(), []
        if req.profile_by_stage:
            return ProfileReqOutput(True, "Profiling starts at the next prefill batch.")
        if req.start_step is not None and req.start_step > batches_run:
            self.start_at = req.start_step
            return ProfileReqOutput(True, f"Profiling starts before batch {req.start_step}.")
        error = self._start()
        return ProfileReqOutput(error is None, error or "Profiling started.")

    def before_batch(self, batch_id: int, is_decode: bool) -> None:
        """Called before every batch is launched (`batch_id`: the scheduler's count, from 1)."""
        req = self.req
        if req.profile_by_stage:
            stage = "DECODE" if is_decode else "EXTEND"
            if self.started and (self.stage != stage or self.steps >= req.num_steps):
                self._write()
            if not self.started and stage in req.stages and stage not in self.stages_done:
                self._start(stage)
            if self.stages_done >= set(req.stages):
                self._finish()
                return
        elif self.start_at is not None:
            if batch_id < self.start_at:
                return
            self.start_at = None
            self._start()
        elif self.started and self.steps >= (req.num_steps or self.max_steps):
            if req.num_steps is None:
                logger.warning(
                    "Profiling stops itself after SGLANG_PROFILE_MAX_STEPS=%d batches.", self.max_steps
                )
            self._end()
            return
        if self.started:
            self.steps += 1

    # ---- the torch profiler ------------------------------------------------------------------------

    def _start(self, stage: str | None = None) -> str | None:
        req = self.req
        cuda = torch.cuda.is_available()
        activities = [torch.profiler.ProfilerActivity.CPU] if "CPU" in req.activities else []
        if "GPU" in req.activities and cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        try:
            if activities:
                config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
                self.profiler = torch.profiler.profile(
                    activities=activities,
                    with_stack=req.with_stack,
                    record_shapes=req.record_shapes,
                    experimental_config=config,
                )
                self.profiler.start()
            if "MEM" in req.activities:
                torch.cuda.memory._record_memory_history(max_entries=100_000)
            if "CUDA_PROFILER" in req.activities:
                torch.cuda.cudart().cudaProfilerStart()
        except Exception as e:  # noqa: BLE001 - the reply says it; the server goes on
            logger.exception("The profiler did not start.")
            self.req = self.profiler = None
            return f"The profiler did not start: {type(e).__name__}: {e}"
        self.stage, self.steps, self.started = stage, 0, True
        where = f" ({stage} batches)" if stage else ""
        logger.info(
            "Profiling starts%s; traces go to %s (profile id %s).", where, req.output_dir, req.profile_id
        )
        return None

    def _write(self) -> str | None:
        """Stop what runs and write its files; the reason where that failed."""
        req, stage = self.req, self.stage
        suffix = f"-{stage}" if stage else ""
        stem = os.path.join(req.output_dir, f"{req.file_prefix}{req.profile_id}-{self.label}{suffix}")
        error = None
        try:
            os.makedirs(req.output_dir, exist_ok=True)
            if self.profiler is not None:
                self.profiler.stop()
                self.profiler.export_chrome_trace(stem + ".trace.json.gz")
                self.written.append(stem + ".trace.json.gz")
            if "MEM" in req.activities:
                torch.cuda.memory._dump_snapshot(stem + "-memory.pickle")
                torch.cuda.memory._record_memory_history(enabled=None)
                self.written.append(stem + "-memory.pickle")
            if "CUDA_PROFILER" in req.activities:
                torch.cuda.cudart().cudaProfilerStop()
        except Exception as e:  # noqa: BLE001 - the reply says it; the server goes on
            logger.exception("The profile was not written.")
            error = f"The profile was not written: {type(e).__name__}: {e}"
        self.profiler, self.started = None, False
        if stage is not None:
            self.stages_done.add(stage)
        self.stage = None
        return error

    def _finish(self) -> ProfileReqOutput:
        logger.info("Profiling done; traces: %s", ", ".join(self.written) or "none")
        self.req, self.start_at = None, None
        return ProfileReqOutput(True, "Profiling done: " + ", ".join(self.written))

    def _end(self) -> ProfileReqOutput:
        started = time.monotonic()
        error = self._write() if self.started else None
        out = self._finish()
        logger.info("Traces written in %.1f s.", time.monotonic() - started)
        return ProfileReqOutput(False, error) if error else out
