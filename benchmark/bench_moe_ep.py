"""One MoE block's routed experts on one CPU rank, expert parallelism against tensor parallelism over 2
ranks: GEMM rows each rank computes and its time (one thread, round-robin medians of 15). Qwen3-Next-80B's per-expert
shapes (hidden 2048, intermediate 512, gated silu, top 10) with 64 experts instead of 512 (memory):

    .venv/bin/python benchmark/bench_moe_ep.py

TP 2: every expert on each rank at intermediate 256, all T k rows. EP 2: 32 whole experts per rank
(intermediate 512), only the rows routed to them; "EP 2 masked" is the earlier form, where other ranks'
assignments ran as weight-0 rows on local expert 0 (all T k rows). Rank 0 is timed (rank 1 is alike).
"""

from __future__ import annotations

import statistics
import time
from unittest import mock

import torch

from sglang.srt.layers.moe import experts as experts_mod
from sglang.srt.layers.moe.experts import RoutedExperts

EXPERTS, TOP_K, HIDDEN, INTER = 64, 10, 2048, 512
REPEATS = 15


def rank_layer(tp: int, ep: int) -> RoutedExperts:
    with (
        mock.patch.object(experts_mod, "get_tensor_model_parallel_world_size", lambda: tp),
        mock.patch.object(experts_mod, "get_moe_expert_parallel_world_size", lambda: ep),
        mock.patch.object(experts_mod, "get_moe_expert_parallel_rank", lambda: 0),
    ):
        m = RoutedExperts(EXPERTS, HIDDEN, INTER, "silu", True)
    torch.nn.init.normal_(m.w13, std=0.02)
    torch.nn.init.normal_(m.w2, std=0.02)
    m.process_weights_after_loading()
    return m


def masked_assignments(self, weights, ids):
    """The earlier `_local_assignments`: other ranks' assignments as weight-0 rows of local expert 0."""
    local = ids - self.expert_offset
    mine = (local >= 0) & (local < self.num_experts)
    return weights * mine, torch.where(mine, local, 0)


def main() -> None:
    torch.set_num_threads(1)
    ep = rank_layer(2, 2)
    masked = rank_layer(2, 2)
    masked._local_assignments = masked_assignments.__get__(masked)
    layers = {"TP 2": rank_layer(2, 1), "EP 2": ep, "EP 2 masked": masked}
    print("| tokens | TP 2 rows / rank | EP 2 rows / rank | TP 2 ms | EP 2 ms | EP 2 masked ms |")
    print("|---|---|---|---|---|---|")
    for tokens in (1, 16, 64, 256):
        g = torch.Generator().manual_seed(tokens)
        x = torch.randn(tokens, HIDDEN, generator=g)
        weights, ids = torch.randn(tokens, EXPERTS, generator=g).softmax(-1).topk(TOP_K)
        rows = {"TP 2": ids.numel(), "EP 2": int((ids < EXPERTS // 2).sum())}
        samples = {name: [] for name in layers}
        with torch.no_grad():
            for layer in layers.values():
                layer(x, weights, ids)
            for _ in range(REPEATS):  # round-robin: a loaded machine's drift hits every form alike
                for name, layer in layers.items():
                    t0 = time.perf_counter()
                    layer(x, weights, ids)
                    samples[name].append(time.perf_counter() - t0)
        times = {name: statistics.median(v) * 1e3 for name, v in samples.items()}
        print(
            f"| {tokens} | {rows['TP 2']} | {rows['EP 2']} | {times['TP 2']:.1f} | {times['EP 2']:.1f} "
            f"| {times['EP 2 masked']:.1f} |"
        )


if __name__ == "__main__":
    main()
