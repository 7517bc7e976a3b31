"""Top-k routing functions. Both return (weights [T, k] float32, expert ids [T, k] int64)."""

from __future__ import annotations

import torch


def softmax_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next: softmax over all experts, keep the top k, renormalise them to sum to 1."""
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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Nemotron-H (DeepSeek-V3 style): sigmoid scores; experts are chosen by score + correction bias,
    first among the `topk_groups` groups whose two best biased scores sum highest, and weighted by the
    unbiased score (renormalised, then scaled)."""
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
