"""The scheduler's torch profiler (upstream's /start_profile and /stop_profile, `Engine.start_profile`).

One `SchedulerProfiler` per scheduler process (every TP rank runs the same messages, so each rank
traces its own forwards and writes its own file). A profile starts when its request arrives, or with
`start_step` before that batch (the scheduler's batch count); with `num_steps` it stops itself after
that many batches (once they have run: the batches in flight are waited for, and an idle server writes
it too), else at /stop_profile, and at the latest after `SGLANG_PROFILE_MAX_STEPS` batches (a trace
grows in memory with every step; upstream has no such bound). With `profile_by_stage` it traces from
the next prefill batch until `num_steps` prefill batches have run, then from the next decode batch
until `num_steps` decode batches have run, into two files (`profile_stages`: one of them only); the
other stage's batches in between are in the trace too.

Traces are Chrome traces: `<output_dir>/[<profile_prefix>-]<profile_id>-TP-<rank>[-DP-<rank>][-<STAGE>]
.trace.json.gz` (open them in Perfetto or chrome://tracing). Every thread is traced (the overlap
schedule's forward thread too). `MEM` (a CUDA memory snapshot, `.pickle`) and `CUDA_PROFILER` (for
`nsys --capture-range=cudaProfilerApi`) need CUDA; `GPU` on a CPU server traces nothing more. A file is
written under a temporary name in its folder, checked again to be inside SGLANG_TORCH_PROFILER_DIR when
it is written, and renamed into place (a symlink of that name is replaced, not followed).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from sglang.srt.managers.io_struct import ProfileReq, ProfileReqOutput
from sglang.srt.managers.profile_request import profile_root
from sglang.srt.utils.atomic_file import write_file

logger = logging.getLogger(__name__)


class SchedulerProfiler:
    def __init__(self, tp_rank: int, dp_rank: int | None, max_steps: int, wait_in_flight: Callable[[], None]):
        """`wait_in_flight`: returns once the batches launched so far have run (the scheduler's)."""
        self.label = f"TP-{tp_rank}" + ("" if dp_rank is None else f"-DP-{dp_rank}")
        self.max_steps = max_steps
        self.wait_in_flight = wait_in_flight
        self.req: ProfileReq | None = None  # the profile asked for, from its start until it ends
        self.profiler: Any = None  # the torch profiler while one runs (None for MEM / CUDA_PROFILER only)
        self.started = False  # tracing now
        self.stage: str | None = None  # "EXTEND" or "DECODE" while a by-stage profile traces one
        self.start_at: int | None = None  # the batch a profile with start_step starts before
        self.steps = 0  # batches counted toward num_steps (by stage: of its stage)
        self.traced = 0  # batches launched while tracing (the SGLANG_PROFILE_MAX_STEPS bound)
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
            self.wait_in_flight()
            return self._end()
        if self.req is not None:
            return ProfileReqOutput(False, "Profiling is already in progress. Call /stop_profile first.")
        self.req, self.steps, self.traced, self.stages_done, self.written = req, 0, 0, set(), []
        if req.profile_by_stage:
            return ProfileReqOutput(True, "Profiling starts at the next batch of its stage.")
        if req.start_step is not None and req.start_step > batches_run:
            self.start_at = req.start_step
            return ProfileReqOutput(True, f"Profiling starts before batch {req.start_step}.")
        error = self._start()
        return ProfileReqOutput(error is None, error or "Profiling started.")

    def abandon(self) -> None:
        """End the profile without writing it (another TP rank could not start its own)."""
        profiler, req = self.profiler, self.req
        self.profiler, self.started, self.stage, self.req, self.start_at = None, False, None, None, None
        if req is not None:
            _stop_tracing(profiler, req)

    def before_batch(self, batch_id: int, is_decode: bool) -> None:
        """Called before every batch is launched (`batch_id`: the scheduler's count, from 1)."""
        req = self.req
        if req.profile_by_stage:
            self._stage_batch("DECODE" if is_decode else "EXTEND")
            return
        if self.start_at is not None:
            if batch_id < self.start_at:
                return
            self.start_at = None
            self._start()
        elif self.started and self.steps >= self._limit():
            self.wait_in_flight()  # (the last traced batch may still run on the forward thread)
            self._end()
            return
        if self.started:
            self.steps += 1
            self.traced += 1

    def on_idle(self) -> None:
        """Nothing runs: a profile whose batches have all run is written now, not at the next batch."""
        req = self.req
        if req.profile_by_stage:
            if self.started and self.steps >= req.num_steps:
                self._write()
                if set(req.stages) <= self.stages_done:
                    self._finish()
        elif self.started and self.steps >= self._limit():
            self._end()

    def _limit(self) -> int:
        if self.req.num_steps is None and self.steps >= self.max_steps:
            logger.warning(
                "Profiling stops itself after SGLANG_PROFILE_MAX_STEPS=%d batches.", self.max_steps
            )
        return self.req.num_steps or self.max_steps

    def _stage_batch(self, stage: str) -> None:
        req = self.req
        if self.started and (self.steps >= req.num_steps or self.traced >= self.max_steps):
            self.wait_in_flight()
            self._write()
            if set(req.stages) <= self.stages_done:
                self._finish()
                return
        if not self.started and stage in req.stages and stage not in self.stages_done:
            self._start(stage)
        if self.started:
            self.traced += 1
            self.steps += stage == self.stage

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
            self.abandon()
            return f"The profiler did not start: {type(e).__name__}: {e}"
        self.stage, self.steps, self.traced, self.started = stage, 0, 0, True  # (each trace its own bound)
        where = f" ({stage} batches)" if stage else ""
        logger.info(
            "Profiling starts%s; traces go to %s (profile id %s).", where, req.output_dir, req.profile_id
        )
        return None

    def _write(self) -> str | None:
        """Stop what traces (always, whatever fails after) and write its files; why not, where it failed."""
        req, stage, profiler = self.req, self.stage, self.profiler
        self.profiler, self.started, self.stage = None, False, None
        if stage is not None:
            self.stages_done.add(stage)
        error = None
        try:
            if profiler is not None:
                profiler.stop()
            name = f"{req.file_prefix}{req.profile_id}-{self.label}" + (f"-{stage}" if stage else "")
            folder = _checked_folder(req.output_dir)
            if profiler is not None:
                self.written.append(
                    write_file(folder, f"{name}.trace.json.gz", profiler.export_chrome_trace)
                )
            if "MEM" in req.activities:
                self.written.append(
                    write_file(folder, f"{name}-memory.pickle", torch.cuda.memory._dump_snapshot)
                )
        except Exception as e:  # noqa: BLE001 - the reply says it; the server goes on
            logger.exception("The profile was not written.")
            error = f"The profile was not written: {type(e).__name__}: {e}"
        finally:
            _stop_tracing(None, req)
        return error

    def _finish(self) -> ProfileReqOutput:
        logger.info("Profiling done; traces: %s", ", ".join(self.written) or "none")
        self.req, self.start_at = None, None
        return ProfileReqOutput(True, "Profiling done: " + (", ".join(self.written) or "no batch ran."))

    def _end(self) -> ProfileReqOutput:
        started = time.monotonic()
        error = self._write() if self.started else None
        out = self._finish()
        logger.info("Traces written in %.1f s.", time.monotonic() - started)
        return ProfileReqOutput(False, error) if error else out


def _stop_tracing(profiler: Any, req: ProfileReq) -> None:
    """Stop the torch profiler (if given), CUDA's memory history and its profiler range, each alone."""
    steps = [profiler.stop] if profiler is not None else []
    if "MEM" in req.activities:
        steps.append(lambda: torch.cuda.memory._record_memory_history(enabled=None))
    if "CUDA_PROFILER" in req.activities:
        steps.append(lambda: torch.cuda.cudart().cudaProfilerStop())
    for step in steps:
        try:
            step()
        except Exception:  # noqa: BLE001 - stopping goes on; nothing else can be done
            logger.exception("Stopping the profiler failed.")


def _checked_folder(output_dir: str) -> str:
    """`output_dir`, made, as it is now: inside SGLANG_TORCH_PROFILER_DIR (a folder on its way swapped
    for a symlink since the request was checked would lead elsewhere)."""
    root = profile_root()

    def inside(path: str) -> bool:
        return path == root or path.startswith(root.rstrip(os.sep) + os.sep)

    real = os.path.realpath(output_dir)
    if not inside(real):
        raise ValueError(f"{output_dir} now leads outside SGLANG_TORCH_PROFILER_DIR ({root})")
    os.makedirs(real, exist_ok=True)
    if os.path.realpath(real) != real:
        raise ValueError(f"{output_dir} changed while it was made")
    return real
