"""Qwen3-Next's routing (softmax over the experts, top k, renormalised) in one Triton launch, the CUDA path
of `router.softmax_topk`, where torch takes five kernels per MoE layer (cast, softmax, top-k, sum,
divide). The arithmetic is the torch form's in float32; among equal probabilities the lower expert id
wins. On CPU tensors the kernel runs only under `TRITON_INTERPRET=1`, for tests.

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


def softmax_topk_triton(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, shared_gate: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] (rows may be strided) -> weights [T, k] float32, ids [T, k] int64, best first.
    `shared_gate`: router_logits is [T, E + 1], its last column the shared expert's gate, and the results
    [T, k + 1] end with the shared expert (id E, weight sigmoid(gate))."""
    t, e = router_logits.shape
    e -= int(shared_gate)
    picks = top_k + int(shared_gate)
    weights = torch.empty(t, picks, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(t, picks, dtype=torch.int64, device=router_logits.device)
    if t == 0:
        return weights, ids
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    jit_for_env(_softmax_topk_kernel)[(t,)](
        logits, weights, ids, logits.stride(0),
        E=e, BE=triton.next_power_of_2(e), K=top_k, BK=triton.next_power_of_2(picks), RENORMALIZE=renormalize,
        SHARED=int(shared_gate),
    )  # fmt: skip
    return weights, ids
