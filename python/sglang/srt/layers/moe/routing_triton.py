"""Qwen3-Next's routing (softmax over the experts, top k, renormalised) in one Triton launch, the CUDA path
of `router.softmax_topk`, where torch takes five kernels per MoE layer (cast, softmax, top-k, sum,
divide); and Nemotron-H's (DeepSeek-V3's grouped sigmoid top-k, `router.grouped_sigmoid_topk`, ~15
kernels in torch) in one: `grouped_sigmoid_topk_triton`. The arithmetic is the torch form's in float32;
among equal scores the lower expert id (group) wins. On CPU tensors the kernels run only under
`TRITON_INTERPRET=1`, for tests.

`shared_gate=True`: the logits carry one column more, the shared expert's gate (Qwen3-Next's
`shared_expert_gate`, its row stacked under the router's: `shared_routing.py`), and the kernel appends the
shared expert as pick k + 1: id E, weight sigmoid(gate). That is the fused GEMMs' form of a layer whose
shared expert they run as expert E (`fused_moe_triton.FusedExperts.fuse_shared`), which otherwise costs
six small launches per layer around the routing (the gate's GEMM, its cast and sigmoid, a fill and two
concatenations): ~22 % of a decode step's kernels at the 80B's layer mix (`kernel_census.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.triton_jit import add, jit_for_env, maximum


def _softmax_topk_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    logits_stride,
    E: tl.constexpr,
    BE: tl.constexpr,
    K: tl.constexpr,
    BK: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SHARED: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    x = tl.load(logits_ptr + t * logits_stride + e, mask=e < E, other=-float("inf")).to(tl.float32)
    p = tl.exp(x - tl.reduce(x, 0, maximum))
    p = p / tl.reduce(p, 0, add)
    p = tl.where(e < E, p, -1.0)
    slots = tl.arange(0, BK)
    # Zeros made from `slots` (tl.zeros is a jitted helper: sglang.srt.utils.triton_jit says why).
    picked_w = slots.to(tl.float32) * 0.0
    picked_id = slots.to(tl.int64) * 0
    for j in tl.static_range(K):
        best = tl.reduce(p, 0, maximum)
        # The lowest id among the best: the largest of (BE - id) where p is the best.
        idx = BE - tl.reduce(tl.where(p == best, BE - e, 0), 0, maximum)
        idx = tl.minimum(idx, E - 1)  # a NaN row matches nothing: keep its ids in range
        picked_w = tl.where(slots == j, best, picked_w)
        picked_id = tl.where(slots == j, idx.to(tl.int64), picked_id)
        p = tl.where(e == idx, -1.0, p)
    if RENORMALIZE:
        picked_w = picked_w / tl.reduce(tl.where(slots < K, picked_w, 0.0), 0, add)
    if SHARED:  # pick K: the shared expert, id E, weighted by its gate's sigmoid (torch's float32 form)
        g = tl.load(logits_ptr + t * logits_stride + E).to(tl.float32)
        picked_w = tl.where(slots == K, 1.0 / (1.0 + tl.exp(-g)), picked_w)
        picked_id = tl.where(slots == K, E, picked_id)
    tl.store(weights_ptr + t * (K + SHARED) + slots, picked_w, mask=slots < K + SHARED)
    tl.store(ids_ptr + t * (K + SHARED) + slots, picked_id, mask=slots < K + SHARED)


def _picks(router_logits: torch.Tensor, picks: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the logits with unit column stride, weights [T, picks] float32, ids [T, picks] int64) for a
    routing launch."""
    t, device = router_logits.shape[0], router_logits.device
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    return logits, torch.empty(t, picks, dtype=torch.float32, device=device), torch.empty(t, picks, dtype=torch.int64, device=device)


def softmax_topk_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, shared_gate: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (rows may be strided) -> weights [T, k] float32, ids [T, k] int64, best first.
    `shared_gate`: router_logits is [T, E + 1], its last column the shared expert's gate, and the results
    [T, k + 1] end with the shared expert (id E, weight sigmoid(gate))."""
    t, e = router_logits.shape
    e -= int(shared_gate)
    picks = top_k + int(shared_gate)
    logits, weights, ids = _picks(router_logits, picks)
    if t == 0:
        return weights, ids
    jit_for_env(_softmax_topk_kernel)[(t,)](
        logits, weights, ids, logits.stride(0),
        E=e, BE=triton.next_power_of_2(e), K=top_k, BK=triton.next_power_of_2(picks), RENORMALIZE=renormalize,
        SHARED=int(shared_gate),
    )  # fmt: skip
    return weights, ids


def _grouped_sigmoid_topk_kernel(
    logits_ptr, bias_ptr, weights_ptr, ids_ptr, logits_stride, scale,
    E: tl.constexpr, BE: tl.constexpr, GROUPS: tl.constexpr, PER_GROUP: tl.constexpr, TOPK_GROUPS: tl.constexpr,
    K: tl.constexpr, BK: tl.constexpr, RENORMALIZE: tl.constexpr,
):  # fmt: skip
    """One token: sigmoid scores; each group's score the sum of its two best biased scores (its best
    alone with one expert a group); the TOPK_GROUPS best groups; among their experts the K best biased
    scores, weighted by their unbiased scores (renormalised, then scaled). Ties: the lower id (group)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    me = e < E
    x = tl.load(logits_ptr + t * logits_stride + e, mask=me, other=0.0).to(tl.float32)
    score = 1.0 / (1.0 + tl.exp(-x))
    biased = tl.where(me, score + tl.load(bias_ptr + e, mask=me, other=0.0).to(tl.float32), -float("inf"))
    group = e // PER_GROUP
    # Each group's two best biased scores, then the groups chosen (a mask over the experts).
    gsel = e < 0  # groups already chosen, as a mask over the experts of those groups
    for _ in tl.static_range(TOPK_GROUPS):
        best_group = -1
        best_score = -float("inf")
        for gi in tl.static_range(GROUPS):
            in_g = group == gi
            vals = tl.where(in_g, biased, -float("inf"))
            top1 = tl.reduce(vals, 0, maximum)
            first = tl.reduce(tl.where(in_g & (vals == top1), BE - e, 0), 0, maximum)  # BE - lowest index
            top2 = tl.reduce(tl.where(e == BE - first, -float("inf"), vals), 0, maximum)
            gscore = top1 + top2 if PER_GROUP > 1 else top1
            taken = tl.reduce(tl.where(in_g & gsel, 1, 0), 0, maximum)
            better = (gscore > best_score) & (taken == 0)
            best_score = tl.where(better, gscore, best_score)
            best_group = tl.where(better, gi, best_group)
        gsel = gsel | (group == best_group)
    chosen = gsel & me
    p = tl.where(chosen, biased, -float("inf"))
    slots = tl.arange(0, BK)
    picked_w = slots.to(tl.float32) * 0.0
    picked_id = slots.to(tl.int64) * 0
    for j in tl.static_range(K):
        best = tl.reduce(p, 0, maximum)
        idx = BE - tl.reduce(tl.where((p == best) & chosen, BE - e, 0), 0, maximum)
        idx = tl.minimum(idx, E - 1)  # a NaN row matches nothing: keep its ids in range
        w = tl.reduce(tl.where(e == idx, score, 0.0), 0, add)
        picked_w = tl.where(slots == j, w, picked_w)
        picked_id = tl.where(slots == j, idx.to(tl.int64), picked_id)
        p = tl.where(e == idx, -float("inf"), p)
        chosen = chosen & (e != idx)
    if RENORMALIZE:
        picked_w = picked_w / (tl.reduce(tl.where(slots < K, picked_w, 0.0), 0, add) + 1e-20)
    picked_w = picked_w * scale
    tl.store(weights_ptr + t * K + slots, picked_w, mask=slots < K)
    tl.store(ids_ptr + t * K + slots, picked_id, mask=slots < K)


def grouped_sigmoid_topk_triton(
    router_logits: torch.Tensor,
    top_k: int,
    correction_bias: torch.Tensor,
    num_groups: int,
    topk_groups: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`router.grouped_sigmoid_topk` in one launch: router_logits [T, E] (rows may be strided) ->
    weights [T, k] float32, ids [T, k] int64, best first."""
    t, e = router_logits.shape
    assert e % num_groups == 0 and top_k <= topk_groups * (e // num_groups)
    logits, weights, ids = _picks(router_logits, top_k)
    if t == 0:
        return weights, ids
    jit_for_env(_grouped_sigmoid_topk_kernel)[(t,)](
        logits, correction_bias.contiguous(), weights, ids, logits.stride(0), float(routed_scaling_factor),
        E=e, BE=triton.next_power_of_2(e), GROUPS=num_groups, PER_GROUP=e // num_groups,
        TOPK_GROUPS=topk_groups, K=top_k, BK=triton.next_power_of_2(top_k), RENORMALIZE=renormalize,
    )  # fmt: skip
    return weights, ids
