"""Sampler time per decode step (CPU, one torch thread): `Sampler` on random logits at batch x vocab
shapes of the tiny presets (2,048) and of Qwen3-Next (151,936), greedy, temperature 1 (SGLang's default
sampling) and temperature 0.7 with top-p 0.9 and top-k 50, medians of --reps calls.

    python benchmark/bench_sampler.py [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang.srt.layers.sampler import Sampler
from sglang.srt.model_executor.forward_batch_info import SamplingBatchInfo

SHAPES = [(16, 2048), (64, 2048), (256, 2048), (1, 151936), (16, 151936)]


def settings(bs: int) -> dict[str, SamplingBatchInfo]:
    return {
        "greedy": SamplingBatchInfo.greedy(bs),
        "T=1": SamplingBatchInfo.create([1.0] * bs),
        "T=0.7 top-p 0.9 top-k 50": SamplingBatchInfo.create([0.7] * bs, [0.9] * bs, [50] * bs),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    sampler = Sampler(random_seed=0)
    print(f"{'batch':>6} {'vocab':>7}  {'setting':<26} {'ms per call':>11}")
    for bs, vocab in SHAPES:
        logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(bs))
        positions = torch.arange(bs) + 100
        for name, info in settings(bs).items():
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                sampler(logits, info, positions)
                times.append(time.perf_counter() - t0)
            print(f"{bs:>6} {vocab:>7}  {name:<26} {statistics.median(times) * 1e3:>11.2f}")


if __name__ == "__main__":
    main()
