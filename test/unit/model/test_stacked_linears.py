"""Linears of one input as one GEMM (layers/stacked_linears.py): the stack's views, its refusals and its
switch; Qwen3-Next's GDN input projections stacked; its MoE router and shared-expert gate stacked with
the routing launch appending the shared pick (layers/moe/shared_routing.py), under `TRITON_INTERPRET=1`
with the fused GEMMs as CUDA runs them, against the unstacked block; a hook (a LoRA adapter's) or a
batch past the fused GEMMs' bound takes the unstacked path. Through the engine against the oracle:
test_cuda_path_on_cpu.py; the kernels they save: test_gpu_bench_scripts.py's census."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.environ import envs
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.stacked_linears import ROW_ALIGN, stack_linear_weights
from sglang.srt.models.qwen3_next import Qwen3NextGatedDeltaNet, Qwen3NextSparseMoeBlock
from sglang.test.ci_register import register_cpu_ci
from sglang.test.moe_checks import TOL_FP16, assert_close_to
from sglang.test.stack_checks import assert_left_as_they_are

register_cpu_ci(est_time=6, suite="per-commit-cpu")


def _linears(*rows: int, cols: int = 16, dtype=torch.float32) -> list[nn.Linear]:
    g = torch.Generator().manual_seed(sum(rows))
    out = []
    for n in rows:
        lin = ReplicatedLinear(cols, n, bias=False).to(dtype)
        lin.weight.data = torch.randn(n, cols, generator=g).to(dtype)
        out.append(lin)
    return out


def test_the_stack_holds_each_weight_as_a_view_of_its_rows():
    a, b = _linears(12, 3)
    before = [a.weight.detach().clone(), b.weight.detach().clone()]
    stack = stack_linear_weights([a, b])
    assert stack.shape == (16, 16)  # 15 rows padded to a multiple of ROW_ALIGN
    assert stack.shape[0] % ROW_ALIGN == 0 and not stack[15:].any()
    assert a.weight.data_ptr() == stack.data_ptr() and b.weight.data_ptr() == stack[12].data_ptr()
    assert torch.equal(a.weight, before[0]) and torch.equal(b.weight, before[1])
    b.weight.data.mul_(2)  # a weight update in place reaches the stack
    assert torch.equal(stack[12:15], 2 * before[1])


@pytest.mark.parametrize("why", ["bias", "dtype", "width", "forward", "switch"])
def test_linears_that_do_not_stack_are_left_as_they_are(why, monkeypatch):
    a, b = _linears(8, 4)
    if why == "bias":
        b.bias = nn.Parameter(torch.zeros(4))
    elif why == "dtype":
        b.to(torch.float16)
    elif why == "width":
        b.weight.data = torch.randn(4, 8)
    elif why == "forward":
        b.forward = lambda x: F.linear(x, b.weight) * 2  # a wrapped module: its own forward stays
    assert_left_as_they_are([a, b], switch_off=why == "switch")


def _gdn_config(**extra) -> SimpleNamespace:
    return SimpleNamespace(
        linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8, linear_value_head_dim=4,
        hidden_size=32, linear_conv_kernel_dim=4, rms_norm_eps=1e-6, **extra,
    )  # fmt: skip


def test_the_gdn_projections_run_as_one_gemm_with_the_same_products():
    layer = Qwen3NextGatedDeltaNet(_gdn_config(), 0)
    nn.init.normal_(layer.in_proj_qkvz.weight)
    nn.init.normal_(layer.in_proj_ba.weight)
    layer.process_weights_after_loading()
    assert layer.in_proj_stack is not None
    assert layer.in_proj_qkvz.weight.data_ptr() == layer.in_proj_stack.data_ptr()
    hidden = torch.randn(5, 32)
    calls = []
    layer.in_proj_ba.register_forward_hook(lambda *a: calls.append(1))
    unstacked = layer._projections(hidden)  # hooked: the modules run, each its own GEMM
    assert calls == [1]
    layer.in_proj_ba._forward_hooks.clear()
    stacked = layer._projections(hidden)
    assert calls == [1]  # one GEMM on the stack, the modules' forwards not called
    for got, want in zip(stacked, unstacked, strict=True):
        assert got.shape == want.shape
        # The same dot products; a CPU GEMM of another width may block K otherwise: float32 rounding.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    again = Qwen3NextGatedDeltaNet(_gdn_config(), 0)
    with envs.SGLANG_STACK_LINEARS.override(False):
        again.process_weights_after_loading()
    assert again.in_proj_stack is None


def test_the_attention_projections_run_as_one_gemm():
    """q (with each head's output gate), k and v of Qwen3-Next's attention from one GEMM on the stack:
    column slices of its product, the values of the three linears' own."""
    from sglang.srt.models.qwen3_next import Qwen3NextAttention

    cfg = SimpleNamespace(
        hidden_size=32, attention_bias=False, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.25, max_position_embeddings=64,
    )  # fmt: skip
    layer = Qwen3NextAttention(cfg, 3)
    for lin in (layer.q_proj, layer.k_proj, layer.v_proj):
        nn.init.normal_(lin.weight)
    hidden = torch.randn(4, 32)
    want = [lin(hidden) for lin in (layer.q_proj, layer.k_proj, layer.v_proj)]
    layer.process_weights_after_loading()
    assert layer.qkv_stack is not None and layer.qkv_stack.shape == (64 + 16 + 16, 32)
    assert layer.v_proj.weight.data_ptr() == layer.qkv_stack[80].data_ptr()
    got = layer._projections(hidden)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)  # (float32: a GEMM of another width)
    layer.k_proj.register_forward_pre_hook(lambda *a: None)
    assert all(t.is_contiguous() for t in layer._projections(hidden))  # hooked: each its own GEMM


def _moe_block() -> Qwen3NextSparseMoeBlock:
    cfg = SimpleNamespace(
        hidden_size=64, num_experts_per_tok=2, num_experts=6, moe_intermediate_size=32, hidden_act="silu",
        shared_expert_intermediate_size=32, norm_topk_prob=True,
    )  # fmt: skip
    block = Qwen3NextSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(3)
    for p in block.parameters():
        fan_in = p.shape[-1]
        p.data = (torch.randn(p.shape, generator=g) / fan_in**0.5).half()
    return block


@pytest.fixture
def fused_on_cpu(monkeypatch):
    """The experts' Triton choices made as on CUDA (`auto`: the fused GEMMs up to 4 tokens here), the
    kernels interpreted."""
    from sglang.srt.layers.moe import experts as ex

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ex, "triton_chosen", lambda choice, *a, **k: choice.get() != "torch")
    monkeypatch.setattr(ex, "FUSED_AUTO_MAX_TOKENS", 4)
    with envs.SGLANG_GPU_MOE_BACKEND.override("auto"), envs.SGLANG_CPU_MOE_BACKEND.override("torch"):
        yield


def test_the_router_and_the_shared_gate_run_as_one_gemm_and_one_routing_launch(fused_on_cpu, monkeypatch):
    from sglang.srt.layers.moe import fused_moe_triton as ft
    from sglang.srt.layers.moe import routing_triton as rt

    stacked, plain = _moe_block(), _moe_block()
    stacked.process_weights_after_loading()
    with envs.SGLANG_STACK_LINEARS.override(False):
        plain.process_weights_after_loading()
    sr = stacked.shared_routing
    assert sr is not None and plain.shared_routing is None
    assert stacked.gate.weight.data_ptr() == sr.stack.data_ptr()
    assert stacked.shared_expert_gate.weight.data_ptr() == sr.stack[6].data_ptr()
    picks, real = [], ft.fused_experts
    monkeypatch.setattr(ft, "fused_experts", lambda *a: picks.append(a[4].clone()) or real(*a))
    launches, real_topk = [], rt.softmax_topk_triton
    monkeypatch.setattr(rt, "softmax_topk_triton", lambda *a, **k: launches.append(k) or real_topk(*a, **k))
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).half()
    got, want = stacked(x), plain(x)
    # The same routing (ids equal: the logits' products are the same dot products) and GEMMs; the
    # shared expert's sigmoid in the routing kernel (float32) where torch computed it: fp16 rounding.
    assert launches == [{"shared_gate": True}, {}]
    assert torch.equal(picks[0], picks[1]) and (picks[0][:, -1] == 6).all()
    assert_close_to(got, want, TOL_FP16)

    # Updates of the router and the shared gate in place reach the stacked GEMM.
    for block in (stacked, plain):
        block.shared_expert_gate.weight.data.mul_(-3)
        block.gate.weight.data[:, ::2] *= 2
    assert_close_to(stacked(x), plain(x), TOL_FP16)
    # --enable-return-routed-experts: the routed picks are recorded, the shared one not.
    recorded = []
    stacked.experts.routing_capture = SimpleNamespace(record=lambda layer, ids: recorded.append(ids.clone()))
    picks.clear()
    stacked(x)
    assert len(recorded) == 1 and torch.equal(recorded[0], picks[0][:, :2])
    stacked.experts.routing_capture = None

    # A hook on the router (an adapter's) or a batch past the fused GEMMs' bound: the unstacked path.
    launches.clear()
    handle = stacked.gate.register_forward_hook(lambda *a: launches.append("hook"))
    assert_close_to(stacked(x), plain(x), TOL_FP16)
    assert launches == ["hook", {}, {}]  # the router's module, then its top-k; the plain block's top-k
    handle.remove()
    launches.clear()
    big = torch.randn(5, 64, generator=torch.Generator().manual_seed(5)).half()
    assert_close_to(stacked(big), plain(big), TOL_FP16)
    assert {"shared_gate": True} not in launches
    # LoRA unfuses a shared expert an adapter changes (`lora_manager.unfuse_shared_experts`): the block
    # routes as before and the experts' call runs the shared expert as its own modules.
    stacked.experts.fused_gemms.shared = None
    launches.clear()
    assert_close_to(stacked(x), plain(x), TOL_FP16)
    assert launches == [{}, {}]


def test_no_stack_without_the_fused_shared_expert(fused_on_cpu):
    """Expert parallelism (other ranks' ids would need remapping) or a shared expert the fused GEMMs did
    not take: the gates stay their own linears."""
    block = _moe_block()
    block.experts.global_num_experts = 12  # this rank holds 6 of 12
    block.process_weights_after_loading()
    assert block.shared_routing is None
    other = copy.deepcopy(_moe_block())
    other.shared_expert_gate.weight.data = other.shared_expert_gate.weight.data.float()  # another dtype
    other.process_weights_after_loading()
    # (nor do the fused GEMMs take a gate of another dtype as expert E's weight)
    assert other.experts.fused_gemms.shared is None and other.shared_routing is None


def test_the_load_gives_back_the_blocks_its_stacks_freed(monkeypatch):
    """On CUDA the start's load empties torch's cache once its steps have run (the storages the stacks
    replaced would count as used where the pools are sized from the free memory); a weight update's load,
    on a thread of its own beside the forward, does not synchronise for it; CPU has nothing to give."""
    import threading

    from sglang.srt.models import registry

    calls = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append(threading.current_thread().name))
    registry.release_cached_blocks(torch.device("cuda"))
    other = threading.Thread(target=registry.release_cached_blocks, args=(torch.device("cuda"),))
    other.start()
    other.join()
    registry.release_cached_blocks(torch.device("cpu"))
    assert calls == [threading.main_thread().name]
