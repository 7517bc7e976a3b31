"""Qwen3-Next's routing kernel (layers/moe/routing_triton.py, the CUDA path) against `softmax_topk`'s torch
form: under `TRITON_INTERPRET=1` on small shapes, compiled for sm_90 at Qwen3-Next-80B's 512 experts /
top-10; through the engine in test_moe_dispatch_triton.py (one switch serves both)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.moe.router import softmax_topk
from sglang.srt.layers.moe.routing_triton import softmax_topk_triton
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")



@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 4), (512, 10), (16, 1)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_form(kernel_device, experts, top_k, renormalize, dtype):
    g = torch.Generator().manual_seed(experts + top_k)
    # Distinct logits in each row (multiples of 1/16 up to 16, exact in bfloat16): without ties torch's
    # order is defined, so both pick the same experts in the same order (ties: the test below).
    logits = torch.stack([torch.randperm(experts, generator=g) for _ in range(9)]).sub(experts // 2).div(16)
    logits = logits.to(kernel_device, dtype)
    want_w, want_ids = softmax_topk(logits, top_k, renormalize)
    got_w, got_ids = softmax_topk_triton(logits, top_k, renormalize)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    # The same float32 softmax with its sums in another order: ~1e-7 relative.
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)


def test_ties_go_to_the_lower_expert_and_each_expert_once(interpret):
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0]])
    w, ids = softmax_topk_triton(logits, 4, False)
    assert ids.tolist() == [[1, 2, 4, 5]]
    assert w[0, 0] == w[0, 1] == w[0, 2] > w[0, 3]


def test_strided_logits_and_an_empty_batch(interpret):
    wide = torch.randn(5, 20)
    logits = wide[:, :10]  # a column slice: rows strided
    want = softmax_topk(logits, 3, True)
    got = softmax_topk_triton(logits, 3, True)
    assert torch.equal(got[1], want[1])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-7)
    w, ids = softmax_topk_triton(torch.zeros(0, 10), 3, True)
    assert w.shape == ids.shape == (0, 3)


@pytest.mark.parametrize("shared", [0, 1])
def test_compiles_for_sm90(shared):
    """Qwen3-Next-80B: 512 experts, top 10, bfloat16 logits (with the shared expert's gate appended:
    `shared`); compiles for an H100 from this CPU machine, without spilling to local memory."""
    from sglang.srt.layers.moe import routing_triton as mod
    from sglang.test.sm90 import compile_sm90_in_registers

    sig = {"logits_ptr": "*bf16", "weights_ptr": "*fp32", "ids_ptr": "*i64", "logits_stride": "i64",
           **{k: "constexpr" for k in ("E", "BE", "K", "BK", "RENORMALIZE", "SHARED")}}  # fmt: skip
    consts = dict(E=512, BE=512, K=10, BK=16, RENORMALIZE=True, SHARED=shared)
    compile_sm90_in_registers(mod._softmax_topk_kernel, sig, consts)


@pytest.mark.parametrize("experts,top_k", [(8, 2), (512, 10), (6, 1)])
def test_the_shared_expert_is_appended_as_the_last_pick(kernel_device, experts, top_k):
    """`shared_gate=True`: logits [T, E + 1] whose last column is the shared expert's gate (rows strided:
    the stacked GEMM's product is sliced) give the routed picks of the first E columns as without it,
    then id E weighted sigmoid(gate) in float32, as `FusedExperts.forward` appends it in torch."""
    g = torch.Generator().manual_seed(experts)
    routed = torch.stack([torch.randperm(experts, generator=g) for _ in range(7)]).sub(experts // 2).div(16)
    gate = torch.randn(7, 1, generator=g) * 4
    wide = torch.cat([routed, gate, torch.zeros(7, 5)], 1).to(kernel_device, torch.bfloat16)
    logits = wide[:, : experts + 1]
    w, ids = softmax_topk_triton(logits, top_k, True, shared_gate=True)
    want_w, want_ids = softmax_topk(logits[:, :experts], top_k, True)
    assert w.shape == ids.shape == (7, top_k + 1)
    assert torch.equal(ids[:, :top_k], want_ids) and (ids[:, top_k] == experts).all()
    torch.testing.assert_close(w[:, :top_k], want_w, rtol=1e-5, atol=1e-7)
    # The sigmoid: 1 / (1 + exp(-x)) where torch has its own; a GPU's exp is ~2 ulp off in float32.
    torch.testing.assert_close(w[:, top_k], torch.sigmoid(logits[:, experts].float()), rtol=1e-6, atol=1e-7)


def test_a_nan_row_keeps_its_ids_in_range(interpret):
    logits = torch.tensor([[float("nan")] * 6, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    _, ids = softmax_topk_triton(logits, 2, True)
    assert ids[0].min() >= 0 and ids[0].max() < 6 and ids[1].tolist() == [5, 4]


@pytest.mark.parametrize(
    "experts,groups,topk_groups,top_k",
    [(8, 1, 1, 2), (128, 1, 1, 6), (64, 8, 4, 6), (16, 4, 2, 3), (12, 3, 3, 9), (8, 8, 3, 3)],
)
@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_sigmoid_topk_matches_the_torch_form(kernel_device, experts, groups, topk_groups, top_k, renormalize):
    """Nemotron-H's routing (DeepSeek-V3's grouped sigmoid top-k) in one launch against
    `router.grouped_sigmoid_topk`: the same experts in the same order (distinct scores: no ties) and
    weights, on strided rows; groups of one expert and groups that all stay chosen included."""
    from sglang.srt.layers.moe.router import grouped_sigmoid_topk
    from sglang.srt.layers.moe.routing_triton import grouped_sigmoid_topk_triton

    g = torch.Generator().manual_seed(experts + top_k)
    wide = torch.randn(7, experts + 3, generator=g) * 2
    logits = wide[:, 1 : experts + 1].to(kernel_device)  # strided rows
    bias = (torch.randn(experts, generator=g) * 0.1).to(kernel_device)
    args = (top_k, bias, groups, topk_groups, renormalize, 2.5)
    want_w, want_ids = grouped_sigmoid_topk(logits, *args)
    got_w, got_ids = grouped_sigmoid_topk_triton(logits, *args)
    assert got_ids.dtype == torch.int64 and got_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    # The same float32 sigmoid (exp by another library, ~1 ulp) and sums in another order.
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


def test_grouped_sigmoid_topk_of_nan_rows_and_empty_batches(interpret):
    from sglang.srt.layers.moe.routing_triton import grouped_sigmoid_topk_triton

    logits = torch.tensor([[float("nan")] * 8, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]])
    _, ids = grouped_sigmoid_topk_triton(logits, 2, torch.zeros(8), 2, 1, True, 1.0)
    assert ids[0].min() >= 0 and ids[0].max() < 8 and ids[1].tolist() == [7, 6]
    w, ids = grouped_sigmoid_topk_triton(torch.zeros(0, 8), 2, torch.zeros(8), 2, 1, True, 1.0)
    assert w.shape == ids.shape == (0, 2)


def test_grouped_sigmoid_topk_compiles_for_sm90():
    """Nemotron 3 Nano's routing (128 experts, one group, top 6) and DeepSeek-V3's grouping (256 experts
    in 8 groups, 4 chosen, top 8): compile for an H100 without spilling to local memory."""
    from sglang.srt.layers.moe import routing_triton as mod
    from sglang.test.sm90 import compile_sm90_in_registers

    sig = {"logits_ptr": "*fp32", "bias_ptr": "*fp32", "weights_ptr": "*fp32", "ids_ptr": "*i64",
           "logits_stride": "i64", "scale": "fp32",
           **{k: "constexpr" for k in ("E", "BE", "GROUPS", "PER_GROUP", "TOPK_GROUPS", "K", "BK", "RENORMALIZE")}}  # fmt: skip
    for e, groups, chosen, k in ((128, 1, 1, 6), (256, 8, 4, 8)):
        consts = dict(E=e, BE=e, GROUPS=groups, PER_GROUP=e // groups, TOPK_GROUPS=chosen, K=k, BK=8, RENORMALIZE=True)
        compile_sm90_in_registers(mod._grouped_sigmoid_topk_kernel, sig, consts)
