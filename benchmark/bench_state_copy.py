"""State-copy ops (`mem_cache/state_copy`): copy, clear and the masked track copy of 1 / 8 / 64 / 256
slots over every layer and both state kinds, for each implementation on the device, next to a plain
`copy_` / `zero_` of the same bytes in the same run.

    python benchmark/bench_state_copy.py [--device cpu|cuda] [--slots 1,8,64,256] [--budget-gb G]

A pool holds 2n + 1 slots (n sources, n destinations, the dummy). Where that exceeds the memory budget,
the pool keeps fewer layers of the same per-layer shapes (the `layers` column): a copy's bandwidth
depends on the bytes per row, not on the layer count. Bandwidth counts bytes read + written for a copy
and bytes written for a clear. All candidates of one row are timed round-robin in shuffled order; times
are medians and ratios are medians of same-round ratios, which keeps a shared machine's load drift (and
the cache state one candidate leaves the next) out of them.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

import torch

from sglang.srt.mem_cache.state_copy import StateCopier

# name: (linear layers, conv row, conv dtype, SSM row, SSM dtype), per TP rank at TP 1.
SHAPES = {
    # 36 GDN layers; conv (4096 + 2*16*128, K - 1) bf16, SSM (32 value heads, 128, 128) fp32: 73.7 MiB/slot.
    "qwen3-next-80b": (36, (8192, 3), torch.bfloat16, (32, 128, 128), torch.float32),
    # Nemotron-H-8B: 24 Mamba2 layers; conv (8192 + 2*8*128, 3) bf16, SSM (128 heads, 64, 128) fp32.
    "nemotron-h-8b": (24, (10240, 3), torch.bfloat16, (128, 64, 128), torch.float32),
    # The built-in tiny presets (float32 model).
    "tiny-qwen3-next": (3, (128, 3), torch.float32, (4, 16, 16), torch.float32),
    "tiny-nemotron-h": (1, (192, 3), torch.float32, (8, 16, 16), torch.float32),
}
IMPLS = {"cpu": ("torch", "cpp"), "cuda": ("torch", "triton", "cuda")}


def _time_once(fn: Callable[[], None], device: str) -> float:
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(cands: dict[str, Callable[[], None]], device: str, seconds: float) -> dict[str, list[float]]:
    """Seconds per call of each candidate, taken round-robin (one call of each per round, in a shuffled
    order), so that a shared machine's load drift and what the previous call left in the caches fall on
    all of them alike; at least 3 rounds, about `seconds` per candidate."""
    for fn in cands.values():
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {k: [] for k in cands}
    order, rng = list(cands), random.Random(0)
    deadline = time.perf_counter() + seconds * len(cands)
    while len(times["copy_"]) < 3 or (time.perf_counter() < deadline and len(times["copy_"]) < 200):
        rng.shuffle(order)
        for name in order:
            times[name].append(_time_once(cands[name], device))
    return times


def bench_one(name: str, n: int, device: str, budget: float, seconds: float) -> dict | None:
    layers, conv, conv_dt, ssm, ssm_dt = SHAPES[name]
    row_bytes = [torch.Size(conv).numel() * conv_dt.itemsize, torch.Size(ssm).numel() * ssm_dt.itemsize]
    num_slots = 2 * n + 1
    fit = int(budget // (num_slots * sum(row_bytes)))
    layers = min(layers, fit)
    if layers == 0:
        return None
    states = [
        torch.randn(layers, num_slots, *conv, device=device).to(conv_dt),
        torch.randn(layers, num_slots, *ssm, device=device).to(ssm_dt),
    ]
    src_t = torch.arange(1, n + 1, device=device)
    dst_t = torch.arange(n + 1, 2 * n + 1, device=device)
    mask = torch.ones(n, dtype=torch.bool, device=device)
    # The same bytes as one contiguous block per tensor: the first n slots' worth of its storage onto
    # the next n slots' worth (disjoint: the tensor holds 2n + 1 slots).
    flats = [(t.view(-1), t.numel() * n // num_slots) for t in states]

    def memcpy() -> None:
        for f, k in flats:
            f[k : 2 * k].copy_(f[:k])

    def memset() -> None:
        for f, k in flats:
            f[:k].zero_()

    cands = {"copy_": memcpy, "zero_": memset}
    for impl in IMPLS[device]:
        try:
            c = StateCopier(states, impl)
        except ValueError as e:
            print(f"  ({impl} unavailable: {e})")
            continue
        cands[f"{impl}.copy"] = lambda c=c: c.copy(src_t, dst_t)
        cands[f"{impl}.clear"] = lambda c=c: c.clear(dst_t)
        cands[f"{impl}.track"] = lambda c=c: c.track_copy(src_t, dst_t, mask)
    times = measure(cands, device, seconds)
    del states
    return {"shape": name, "layers": layers, "slots": n, "bytes": n * layers * sum(row_bytes), "times": times}


def _ratio(num: list[float], den: list[float]) -> float:
    """Median over rounds of num / den, both taken in the same round."""
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def report(row: dict) -> None:
    t, moved = row["times"], row["bytes"]
    cp, zr = statistics.median(t["copy_"]), statistics.median(t["zero_"])
    print(
        f"{row['shape']:16s} {row['layers']:3d} layers {row['slots']:4d} slots {moved / 2**20:9.1f} MiB | "
        f"copy_ {cp * 1e3:9.3f} ms ({2 * moved / cp / 1e9:7.1f} GB/s)  zero_ {zr * 1e3:9.3f} ms  "
        f"[{len(t['copy_'])} rounds]"
    )
    for impl in ("torch", "cpp", "triton", "cuda"):
        if f"{impl}.copy" not in t:
            continue
        c, z, k = (t[f"{impl}.{op}"] for op in ("copy", "clear", "track"))
        mc = statistics.median(c)
        vs_torch = f"  copy {_ratio(t['torch.copy'], c):5.1f}x torch" if impl != "torch" else ""
        print(
            f"    {impl:7s} copy {mc * 1e3:9.3f} ms ({2 * moved / mc / 1e9:7.1f} GB/s, "
            f"{_ratio(t['copy_'], c):4.2f}x copy_ bw)  clear {statistics.median(z) * 1e3:9.3f} ms "
            f"({_ratio(t['zero_'], z):4.2f}x zero_ bw)  track {statistics.median(k) * 1e3:9.3f} ms "
            f"({_ratio(k, t['copy_']):4.2f}x copy_ time){vs_torch}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"]
    )
    parser.add_argument("--slots", default="1,8,64,256")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument(
        "--budget-gb", type=float, default=None, help="Pool memory cap (default: cpu 3, cuda 30)."
    )
    parser.add_argument("--seconds", type=float, default=0.3, help="About this long per candidate and row.")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch / OpenMP threads (CPU; default: torch's)."
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    budget = (args.budget_gb or (3.0 if args.device == "cpu" else 30.0)) * 2**30
    print(f"device {args.device}, {torch.get_num_threads()} threads, pool budget {budget / 2**30:.1f} GiB")
    for name in args.shapes.split(","):
        for n in (int(s) for s in args.slots.split(",")):
            row = bench_one(name, n, args.device, budget, args.seconds)
            if row is None:
                print(f"{name}: {n} slots do not fit the budget with one layer")
                continue
            report(row)


if __name__ == "__main__":
    main()
