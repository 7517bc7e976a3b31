"""Checks of the fused 16-bit MoE GEMMs (layers/moe/fused_moe_triton.py) shared by their per-commit and
nightly test files: experts and routing of given shapes, and the layer's forward under
SGLANG_GPU_MOE_BACKEND=triton_fused against its torch path."""

from __future__ import annotations

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.moe import fused_moe_triton as ft
from sglang.srt.layers.moe.experts import RoutedExperts

# The paths round differently: the fused GEMM rounds silu(gate) * up once from float32, the torch path
# rounds h, then the product (float16: 2^-11 each), and sums in other orders; a few such steps carried
# through w2's I-long sums stay far below 2^-7 of the outputs' scale, and a wrong expert, row or
# weight is O(1).
TOL_FP16 = 2**-7


def make_layer(e: int, hidden: int, inter: int, act: str, gated: bool, dtype=torch.float16, device="cpu"):
    """RoutedExperts with random weights of O(1 / sqrt(fan-in)), so that outputs stay O(1)."""
    layer = RoutedExperts(e, hidden, inter, act, gated=gated)
    g = torch.Generator(device=device).manual_seed(e + hidden)
    for p in (layer.w13, layer.w2):
        p.data = (torch.randn(p.shape, generator=g, device=device) / p.shape[2] ** 0.5).to(dtype)
    return layer


def routing(tokens: int, top_k: int, e: int, seed: int, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in [0, 1), distinct expert ids [T, k])."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=g).to(device), ids.to(device)


def assert_close_to(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    scale = want.float().abs().max().item()
    assert scale > 0.05  # outputs of O(1): the bound is relative to them
    torch.testing.assert_close(got.float(), want.float(), rtol=rel, atol=rel * scale)


def check_layer_runs_fused(monkeypatch, tokens: int, top_k: int, e: int, act: str, gated: bool) -> None:
    """Under TRITON_INTERPRET=1 (float16, 64 hidden, 32 wide): with SGLANG_GPU_MOE_BACKEND=triton_fused
    the layer's forward runs `fused_experts` once (silu_and_mul for gated silu experts, the relu2
    epilogue for plain relu2 ones) and equals forward_device's padded block within TOL_FP16."""
    layer = make_layer(e, 64, 32, act, gated)
    calls = []
    real = ft.fused_experts
    monkeypatch.setattr(ft, "fused_experts", lambda *a: calls.append((a[6], a[8])) or real(*a))
    with envs.SGLANG_GPU_MOE_BACKEND.override("triton_fused"), envs.SGLANG_CPU_MOE_BACKEND.override("torch"):
        layer.process_weights_after_loading()
    assert layer.fused_gemms.table == {}  # no tuned file for "cpu": the fallback tiles
    weights, ids = routing(tokens, top_k, e, seed=tokens)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(3)).half()
    got = layer(x, weights, ids)
    assert calls == [(gated and act == "silu", not gated and act == "relu2")]
    assert_close_to(got, layer.forward_device(x, weights, ids, grouped=False), TOL_FP16)
