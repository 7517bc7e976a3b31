"""Where one decode step goes, on the model runner (no scheduler): the issue's breakdown of wall time, GPU
kernel time, kernel launches and host syncs per step, at batch 1 and 64, with CUDA graphs on and off.

    python benchmark/gpu/bench_decode_step.py                       # on the GPU machine, ~1 min
    python benchmark/gpu/bench_decode_step.py --device cpu --small  # a CPU check of the script

Model: `bench_engine_vs_hf.py`'s random ~150M Qwen3-Next (bfloat16 on CUDA). Each request is prefilled
with 256 tokens, then decoded. Wall: median of `--steps` timed steps, each ending in the driver's read of
the sampled ids (the one sync a step is allowed). Kernels, launches and syncs: `torch.profiler` over 5
steps, divided by 5; launches and syncs are counted inside the steps only (stopping the profiler
synchronizes the device too). On CUDA the 12 kernels that take the most GPU time per step follow each
row (also in the JSON). A launch is a `cudaLaunchKernel`-like runtime call or one `cudaGraphLaunch`; a
sync is a runtime call that waits for the device (stream / event / device synchronize, a blocking
memcpy). `--host-profile N` adds, per row, the host functions that take the most time over N more steps
(cProfile, by own time): where the wall time beyond the GPU's goes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_engine_vs_hf import write_checkpoint  # noqa: E402

PROFILED = 5
STEP = "decode_step"
TOP_KERNELS = 12
SYNC_CALLS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
LAUNCH_CALLS = (
    "cudaLaunchKernel",
    "cuLaunchKernel",
    "cudaLaunchKernelExC",
    "cuLaunchKernelEx",
    "cudaGraphLaunch",
)


def _runner(path: Path, device: str, dtype: str, graphs: bool, max_bs: int):
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path=str(path),
        device=device,
        dtype=dtype,
        max_total_tokens=max_bs * 512,
        max_mamba_cache_size=max_bs * 2 + 2,
        max_running_requests=max_bs,
        disable_cuda_graph=not graphs,
        random_seed=0,
    )
    return ModelRunner(args)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _host_profile(driver, reqs, steps: int) -> list[str]:
    """cProfile over `steps` decode steps: the 15 functions with the most own time, per step."""
    import cProfile

    from sglang.srt.utils.host_profile import top_rows

    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        driver.decode(reqs)
    prof.disable()
    return top_rows(prof, 15, per=steps, unit="us")


def measure(runner, device: str, batch: int, steps: int, prompt_len: int, host_profile: int = 0) -> dict:
    from sglang.test.runner_driver import Extend, RunnerDriver

    driver = RunnerDriver(runner)
    reqs = [driver.new_request() for _ in range(batch)]
    g = torch.Generator().manual_seed(batch)
    for i in range(0, batch, 8):  # prefill in groups of 8 requests
        group = reqs[i : i + 8]
        driver.extend(
            [Extend(r, torch.randint(10, 2000, (prompt_len,), generator=g).tolist()) for r in group]
        )
    for _ in range(3):  # warm-up (and Triton compiles)
        driver.decode(reqs)
    _sync(device)
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        driver.decode(reqs)  # ends in next_token_ids.tolist()
        walls.append(time.perf_counter() - t)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(PROFILED):
            with torch.profiler.record_function(STEP):
                driver.decode(reqs)  # the last step's read of the ids waits for the device
    # Host calls count inside the steps only: the profiler's own stop synchronizes the device too.
    # Kineto also reports each range as a GPU-side annotation: the host's ranges are the CPU ones.
    cpu = torch.autograd.DeviceType.CPU
    steps_at = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.name == STEP and e.device_type == cpu
    ]
    assert len(steps_at) == PROFILED, steps_at

    def in_a_step(ev) -> bool:
        return any(start <= ev.time_range.start <= end for start, end in steps_at)

    kernel_us, launches, syncs = 0.0, 0, 0
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            if ev.name != STEP:  # the annotation spans the step's kernels: not a kernel itself
                kernel_us += ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        elif ev.name.startswith(LAUNCH_CALLS) and in_a_step(ev):
            launches += 1
        elif ev.name in SYNC_CALLS and in_a_step(ev):
            syncs += 1
    host = _host_profile(driver, reqs, host_profile) if host_profile else []
    for r in reqs:
        driver.free(r)
    return {
        "batch": batch,
        "wall_ms": round(statistics.median(walls) * 1e3, 3),
        "gpu_kernel_ms": round(kernel_us / PROFILED / 1e3, 3),
        "launches": launches / PROFILED,
        "host_syncs": syncs / PROFILED,
        "top_kernels": _top_kernels(prof) if device == "cuda" else [],
        "host_profile": host,
    }


def _top_kernels(prof, per: int = PROFILED, skip: str = STEP) -> list[str]:
    """The kernels that take the most GPU time per step (`per` steps profiled; `skip`, an annotation, is
    not a kernel): "us per step, launches per step, name"."""
    rows = []
    for avg in prof.key_averages():
        if avg.device_type != torch.autograd.DeviceType.CUDA or avg.key == skip:
            continue  # host ops (their device time is their kernels') and the step annotation
        us = getattr(avg, "self_device_time_total", 0.0)
        if us > 0:
            rows.append((us / per, avg.count / per, avg.key[:90]))
    rows.sort(reverse=True)
    return [f"{us:8.1f} us {count:5.1f}x {name}" for us, count, name in rows[:TOP_KERNELS]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--small", action="store_true", help="a narrow model, batches 1 and 4 (CPU check)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--host-profile", type=int, default=0, metavar="N", help="cProfile N more steps per row")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    batches, prompt_len = ((1, 4), 32) if args.small else ((1, 64), 256)
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp), args.small)
        for graphs in (True, False) if args.device == "cuda" else (False,):
            runner = _runner(path, args.device, dtype, graphs, max(batches))
            for batch in batches:
                row = {"cuda_graphs": graphs, **measure(runner, args.device, batch, args.steps, prompt_len, args.host_profile)}
                rows.append(row)
                print(json.dumps({k: v for k, v in row.items() if k not in ("top_kernels", "host_profile")}))
                print("".join(f"    {line}\n" for line in row["top_kernels"] + row["host_profile"]), end="", flush=True)
            del runner
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
