"""Top-k routing functions. Both return (weights [T, k] float32, expert ids [T, k] int64). `ops`: the
C++ ops where they serve the caller's layer on CPU (set at load where its routed experts run the C++
op), one call each (`sgl-kernel/csrc/moe_routing_cpu.cpp`) instead of 5 and ~12 small torch ops for
decode-size batches of small layers; None for the torch path."""

from __future__ import annotations

from typing import Any

import torch

# The C++ top-k runs on one thread and scans the experts once per pick, so it serves decode-size batches
# of small layers only: it beat torch's ops at 8 experts, while at 512 experts, top-10, torch's ops were
# faster already at 16 tokens (timings: benchmark/README.md).
CPU_ROUTING_MAX_TOKENS = 256
CPU_ROUTING_MAX_EXPERTS = 64


def cpp_routes(ops: Any | None, tokens: int, experts: int) -> bool:
    """Whether the C++ top-k routes `tokens` tokens over `experts` experts."""
    return ops is not None and tokens <= CPU_ROUTING_MAX_TOKENS and experts <= CPU_ROUTING_MAX_EXPERTS


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, ops: Any | None = None, triton: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next: softmax over all experts, keep the top k, renormalise them to sum to 1. `triton`: one
    Triton launch (`routing_triton.py`, the CUDA path, SGLANG_GPU_MOE_BACKEND)."""
    if triton:
        from sglang.srt.layers.moe.routing_triton import softmax_topk_triton

        return softmax_topk_triton(router_logits, top_k, renormalize)
    if cpp_routes(ops, *router_logits.shape):
        return ops.topk_softmax(router_logits.float().contiguous(), top_k, renormalize)
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_sigmoid_topk(
    router_logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float,
    ops: Any | None = None,
    triton: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nemotron-H (DeepSeek-V3 style): sigmoid scores; experts are chosen by score + correction bias,
    first among the `topk_groups` groups whose two best biased scores sum highest, and weighted by the
    unbiased score (renormalised, then scaled). `triton`: one Triton launch (`routing_triton.py`, the
    CUDA path, SGLANG_GPU_MOE_BACKEND)."""
    if triton:
        from sglang.srt.layers.moe.routing_triton import grouped_sigmoid_topk_triton

        return grouped_sigmoid_topk_triton(
            router_logits, top_k, correction_bias, num_groups, topk_groups, renormalize, routed_scaling_factor
        )
    if cpp_routes(ops, *router_logits.shape):
        return ops.biased_grouped_topk(
            router_logits.float().contiguous(),
            correction_bias.float().contiguous(),
            top_k,
            num_groups,
            topk_groups,
            renormalize,
            routed_scaling_factor,
        )
    scores = router_logits.float().sigmoid()
    biased = scores + correction_bias.float()
    num_tokens, num_experts = biased.shape
    grouped = biased.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
    best_groups = group_scores.topk(topk_groups, dim=-1).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
