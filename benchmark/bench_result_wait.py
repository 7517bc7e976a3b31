"""What the scheduler's wait for a result copy costs the forward thread, on a CPU (the GIL is the
same on the GPU machine): the forward thread runs bursts of small torch ops (a batch's launches:
each op releases and retakes the GIL) while the scheduler thread waits for the previous burst's
"copy", an event that completes a fixed time after it is recorded (`--device-ms`, the GPU's step).

    python benchmark/bench_result_wait.py              # ~20 s
    python benchmark/bench_result_wait.py --load 2     # with 2 busy processes beside (cores taken)

Three ways of waiting, alternated round by round, the forward thread's time per burst (median):
- `alone`: nobody waits (the burst's own time);
- `poll 50 us`: the scheduler polls `event.query()` every 50 us (the wait before `CopyWaiter`);
- `CopyWaiter`: the scheduler blocks on the future `forward_worker.CopyWaiter` completes, its thread
  waiting in `event.synchronize()` without the GIL (CUDA's also spins a core meanwhile; this one sleeps).
"""

from __future__ import annotations

import argparse
import json
import queue
import statistics
import subprocess
import sys
import threading
import time

import torch

from sglang.srt.model_executor.forward_worker import CopyWaiter


class FakeCopyEvent:
    """A result copy's CUDA event stand-in: done `seconds` after it is made; `synchronize` sleeps with
    the GIL released (cudaEventSynchronize releases it too, but spins on its core on CUDA's default
    flags: this measures the GIL's part only)."""

    def __init__(self, seconds: float):
        self.done_at = time.perf_counter() + seconds

    def query(self) -> bool:
        return time.perf_counter() >= self.done_at

    def synchronize(self) -> None:
        left = self.done_at - time.perf_counter()
        if left > 0:
            time.sleep(left)


def burst(x: torch.Tensor, ops: int) -> float:
    """`ops` small torch ops, as a batch's launches; returns the seconds taken."""
    start = time.perf_counter()
    for _ in range(ops // 2):
        y = x + 1
        y = y[: x.numel() // 2]
    return time.perf_counter() - start


def run(mode: str, steps: int, ops: int, device_s: float) -> float:
    """Median seconds per burst of the forward thread while the scheduler waits in `mode`."""
    x = torch.zeros(64, dtype=torch.int64)
    handed: queue.SimpleQueue = queue.SimpleQueue()
    waiter = CopyWaiter() if mode == "CopyWaiter" else None
    times: list[float] = []

    def forward() -> None:
        for _ in range(steps):
            times.append(burst(x, ops))
            event = FakeCopyEvent(device_s)
            handed.put(waiter.watch(event) if waiter else event)
        handed.put(None)

    thread = threading.Thread(target=forward)
    thread.start()
    while (item := handed.get()) is not None:
        if mode == "poll 50 us":
            while not item.query():
                time.sleep(50e-6)
        elif mode == "CopyWaiter":
            item.result(timeout=10)
    thread.join()
    if waiter:
        waiter.shutdown()
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--ops", type=int, default=300, help="torch ops per burst")
    parser.add_argument("--device-ms", type=float, default=1.0, help="when each copy completes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--load", type=int, default=0, help="busy processes running beside")
    args = parser.parse_args()
    torch.set_num_threads(1)
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    try:
        measure(args)
    finally:
        for p in spinners:
            p.kill()


def measure(args: argparse.Namespace) -> None:
    modes = ("alone", "poll 50 us", "CopyWaiter")
    medians: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(args.rounds):
        for mode in modes:
            medians[mode].append(run(mode, args.steps, args.ops, args.device_ms / 1e3))
    us = {m: round(statistics.median(v) * 1e6, 1) for m, v in medians.items()}
    print(json.dumps({
        "burst_us": us, "ops_per_burst": args.ops, "device_ms": args.device_ms, "load": args.load,
        "poll_over_alone": round(us["poll 50 us"] / us["alone"], 3),
        "copy_waiter_over_alone": round(us["CopyWaiter"] / us["alone"], 3),
    }))  # fmt: skip


if __name__ == "__main__":
    main()
