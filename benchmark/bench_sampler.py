"""Sampler time per decode step (CPU, one torch thread): `Sampler` on random logits at batch x vocab
shapes of the tiny presets (2,048) and of Qwen3-Next (151,936), greedy, temperature 1 (SGLang's default
sampling), temperature 0.7 with top-p 0.9 and top-k 50, and with top-p 0.95 alone, medians of --reps
calls. Random logits (standard normal times --logit-scale) at scale 1 are flatter than a trained
model's: top-p 0.95 alone then keeps most of the vocabulary and the sampler sorts all of it; at scale 4
the cut lies among the few most likely tokens, as it does in serving.

    python benchmark/bench_sampler.py [--reps 15] [--logit-scale 1] [--device cpu]

On a GPU (`--device cuda`) each call is timed to a synchronize; the torch form runs there.
"""

from __future__ import annotations

import argparse
import copy
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
        "T=0.7 top-p 0.95": SamplingBatchInfo.create([0.7] * bs, [0.95] * bs),
    }


def _on(info: SamplingBatchInfo, device: torch.device) -> SamplingBatchInfo:
    moved = copy.copy(info)
    for name in SamplingBatchInfo.TENSOR_FIELDS:
        tensor = getattr(info, name)
        if tensor is not None:
            setattr(moved, name, tensor.to(device))
    return moved


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--logit-scale", type=float, default=1.0)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    sampler = Sampler(random_seed=0)
    print(f"{'batch':>6} {'vocab':>7}  {'setting':<26} {'ms per call':>11}")
    for bs, vocab in SHAPES:
        logits = torch.randn(bs, vocab, generator=torch.Generator().manual_seed(bs)) * args.logit_scale
        logits, positions = logits.to(device), (torch.arange(bs) + 100).to(device)
        for name, info in settings(bs).items():
            info = _on(info, device)
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                sampler(logits, info, positions)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            print(f"{bs:>6} {vocab:>7}  {name:<26} {statistics.median(times) * 1e3:>11.2f}")


if __name__ == "__main__":
    main()
