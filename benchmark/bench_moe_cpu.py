"""Routed experts on CPU: torch's grouped GEMMs (`RoutedExperts.forward_device`) against sgl-kernel's C++
op (`moe_experts`, the default for small experts at decode sizes; `SGLANG_CPU_MOE_BACKEND`), one thread,
round-robin medians of 30:

    .venv/bin/python benchmark/bench_moe_cpu.py

Shapes: the tiny presets' experts (8 x top-2 gated silu, 4 x top-2 relu2; hidden 64, intermediate 32) from
1 to 512 tokens, then larger experts, which set `CPU_OP_MAX_EXPERT_WEIGHTS` (past it the layer keeps
the GEMMs).
"""

from __future__ import annotations

import statistics
import time

import torch

from sglang.srt.layers.cpu_ops import cpu_moe_ops
from sglang.srt.layers.moe.experts import RoutedExperts

# (tokens, experts, top-k, hidden, intermediate, activation, gated)
SHAPES = [
    *[(t, 8, 2, 64, 32, "silu", True) for t in (1, 16, 64, 256, 512)],
    (256, 4, 2, 128, 128, "silu", True),  # the demo model's experts at a 256-request decode
    (16, 4, 2, 64, 32, "relu2", False),
    (64, 4, 2, 64, 32, "relu2", False),
    (16, 16, 2, 256, 128, "silu", True),
    (64, 16, 2, 256, 128, "silu", True),
    (16, 32, 4, 512, 256, "silu", True),
    (16, 64, 8, 512, 256, "silu", True),
]


def row(tokens: int, experts: int, top_k: int, hidden: int, inter: int, act: str, gated: bool) -> str:
    torch.manual_seed(0)
    m = RoutedExperts(experts, hidden, inter, act, gated)
    torch.nn.init.normal_(m.w13, std=0.1)
    torch.nn.init.normal_(m.w2, std=0.1)
    x = torch.randn(tokens, hidden)
    weights, ids = torch.randn(tokens, experts).softmax(-1).topk(top_k)
    ops = cpu_moe_ops("cpu")
    w13t, w2t = m.w13.transpose(1, 2).contiguous(), m.w2.transpose(1, 2).contiguous()
    code = m.act_code
    ways = {
        "grouped GEMMs": lambda: m.forward_device(x, weights, ids),
        "C++": lambda: ops.moe_experts(x, w13t, w2t, weights, ids, gated, code),
    }
    assert torch.allclose(ways["C++"](), ways["grouped GEMMs"](), atol=1e-4, rtol=1e-4)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(30):
        for name, fn in ways.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    a, b = (statistics.median(times[name]) * 1e6 for name in ways)
    per_expert = m.w13[0].numel() + m.w2[0].numel()
    return (
        f"| {tokens} | {experts} x top-{top_k}, {hidden}/{inter} {act} | {per_expert:,} | {a:.0f} | {b:.0f} "
        f"| {a / b:.2f} |"
    )


def main() -> None:
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    assert cpu_moe_ops("cpu") is not None, "build sgl-kernel first: python -m sglang.srt.utils.sgl_kernel"
    print(
        "| tokens | experts, hidden/inter | weights per expert | grouped GEMMs us | C++ us | GEMMs / C++ |\n"
        "|---|---|---|---|---|---|"
    )
    for shape in SHAPES:
        print(row(*shape), flush=True)


if __name__ == "__main__":
    main()
