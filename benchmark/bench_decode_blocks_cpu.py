"""CPU decode with each decoder block as one sgl-kernel call (`layers/decode_blocks.py`, the default) against
the same blocks' parts called one by one (`SGLANG_CPU_DECODE_BLOCKS=0`), in one process, one torch thread:

    .venv/bin/python benchmark/bench_decode_blocks_cpu.py            # both presets, 6 rounds, ~1 min
    .venv/bin/python benchmark/bench_decode_blocks_cpu.py --preset tiny-nemotron-h --rounds 10
    .venv/bin/python benchmark/bench_decode_blocks_cpu.py --preset tiny-qwen3-next-demo   # the server's default

The workload is one turn of issue 19's multi-turn one: 16 requests of a shared 1,024-token prompt plus
128 own tokens, 128 greedy tokens each, through a `Scheduler` driven in-process (extra_buffer_lazy). The
two ways alternate turn by turn (each turn new own tokens, the shared prompt cached); printed are the
medians over rounds of each turn's wall time and of its decode steps' median time (the model runner's
forward, sampling included), and their ratios.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang.srt.layers.decode_blocks import built_blocks
from sglang.test.scheduler_harness import SchedulerHarness, token_ids


def measure(preset: str, rounds: int) -> str:
    h = SchedulerHarness(
        preset,
        mamba_scheduler_strategy="extra_buffer_lazy",
        max_total_tokens=65536,
        max_mamba_cache_size=96,
        max_running_requests=32,
    )
    runner = h.sched.model_runner
    built = built_blocks(runner.model)
    assert built, "no decode blocks were built (SGLANG_CPU_DECODE_BLOCKS=0, or the CPU extension is missing)"

    def use_blocks(on: bool) -> None:
        for module, attr, block in built:
            setattr(module, attr, block if on else None)

    steps: list[float] = []
    forward = runner.forward_batch_generation

    def timed(fb):
        t = time.perf_counter()
        out = forward(fb)
        if fb.forward_mode.is_decode():
            steps.append(time.perf_counter() - t)
        return out

    runner.forward_batch_generation = timed
    system = token_ids(1024, seed=1)
    seeds = iter(range(1, 10**6))

    def turn() -> tuple[float, float]:
        steps.clear()
        t = time.perf_counter()
        seed = next(seeds)
        for c in range(16):
            h.submit(system + token_ids(128, seed=1000 * seed + c), max_new_tokens=128, return_logprob=False)
        h.run()
        return time.perf_counter() - t, statistics.median(steps)

    turn()  # the shared prompt into the cache, everything warm
    results: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for _ in range(rounds):
        for on in (True, False):
            use_blocks(on)
            results[on].append(turn())
    wall = {on: statistics.median(r[0] for r in results[on]) for on in results}
    step = {on: statistics.median(r[1] for r in results[on]) for on in results}
    return (
        f"| {preset} | {step[False] * 1e3:.2f} | {step[True] * 1e3:.2f} | {step[True] / step[False]:.2f} "
        f"| {wall[False]:.3f} | {wall[True]:.3f} | {wall[True] / wall[False]:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--preset", choices=["tiny-qwen3-next", "tiny-nemotron-h", "tiny-qwen3-next-demo"], action="append"
    )
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| preset | decode step, parts ms | blocks ms | ratio | turn, parts s | blocks s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for preset in args.preset or ["tiny-qwen3-next", "tiny-nemotron-h"]:
        print(measure(preset, args.rounds), flush=True)


if __name__ == "__main__":
    main()
