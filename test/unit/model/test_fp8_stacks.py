"""Block-FP8 linears of one input as one GEMM (`stacked_linears.Fp8Stack`: each member's rows from a scale
block, its bytes and scales as they were) and an FP8 MoE layer's shared expert run as expert E of its
FP8 experts (`moe/fp8_fused_experts.py`), with the router and the shared gate as one GEMM
(`shared_routing.py`): under `TRITON_INTERPRET=1` as CUDA runs them, against the layers apart. Through
the engine: test_fp8_experts.py (CUDA's layout on the CPU); the launches they save:
test_gpu_bench_scripts.py's census."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from sglang.srt.environ import envs
from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, Fp8BlockLinear, quantize_block_fp8
from sglang.srt.layers.quantization.fp8_experts import make_fp8_experts
from sglang.srt.layers.stacked_linears import Fp8Stack, stack_linear_weights, stacked_outputs
from sglang.srt.models.qwen3_next import Qwen3NextSparseMoeBlock
from sglang.test.ci_register import register_cpu_ci
from sglang.test.moe_checks import TOL_FP16, assert_close_to
from sglang.test.stack_checks import assert_left_as_they_are

register_cpu_ci(est_time=8, suite="per-commit-cpu")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _fp8_linears(*rows: int, cols: int = 192, seed: int = 0) -> list[Fp8BlockLinear]:
    """FP8 linears of random weights, rows of any count (partial 128-row blocks included)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in rows:
        lin = Fp8BlockLinear(cols, n)
        lin.load_dense(torch.randn(n, cols, generator=g) / cols**0.5)
        out.append(lin)
    return out


def test_fp8_linears_stack_from_block_rows_with_their_bytes_and_scales():
    """Members of 200, 64 and 130 rows start at rows 0, 256 and 384 (zero rows, scale 1, fill the
    blocks they end inside), hold their bytes and scales as views of the stack (an update in place
    reaches it), and the stacked GEMM's column slices are each member's own output."""
    linears = _fp8_linears(200, 64, 130)
    before = [(lin.weight.detach().clone(), lin.weight_scale_inv.detach().clone()) for lin in linears]
    x = torch.randn(5, 192, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = [lin(x) for lin in linears]
    stack = stack_linear_weights(linears)
    assert isinstance(stack, Fp8Stack)
    # (514 rows, padded to 520 as a 16-bit stack's are: still 5 rows of scale blocks)
    assert stack.starts == (0, 256, 384) and stack.weight.shape == (520, 192)
    assert stack.scale_inv.shape == (5, 2)
    assert stack.weight.dtype == FP8_DTYPE and stack.kernel is None  # (CPU: the dequantized torch path)
    for lin, start, (w, s) in zip(linears, stack.starts, before, strict=True):
        assert torch.equal(_bits(lin.weight), _bits(w)) and torch.equal(lin.weight_scale_inv, s)
        assert lin.weight.data_ptr() == stack.weight[start].data_ptr()
        assert lin.weight_scale_inv.data_ptr() == stack.scale_inv[start // 128].data_ptr()
    assert not stack.weight[200:256].float().any() and not stack.weight[320:384].float().any()
    assert not stack.weight[514:].float().any()
    got = stacked_outputs(x, tuple(linears), stack)
    for g_, w_ in zip(got, want, strict=True):
        assert g_.shape == w_.shape
        # The same dequantized weights and products in float64: only the summation order may differ.
        torch.testing.assert_close(g_, w_, rtol=1e-12, atol=1e-12)
    q, s = quantize_block_fp8(torch.randn(64, 192, generator=torch.Generator().manual_seed(2)))
    linears[1].weight.data.copy_(q)  # a weight update in place reaches the stacked GEMM
    linears[1].weight_scale_inv.data.copy_(s)
    torch.testing.assert_close(
        stacked_outputs(x, tuple(linears), stack)[1], linears[1](x), rtol=1e-12, atol=1e-12
    )


def test_fp8_stacks_under_the_kernel_equal_the_members_kernels(monkeypatch):
    """The Triton block GEMM (interpreted) on the stack: one activation quantization and one GEMM whose
    columns are the members' own GEMMs' (the same quantized activations, the same K blocks in the
    same order: equal up to float32 rounding, which a decode-size split of K may reorder)."""
    from sglang.srt.layers.quantization import fp8_kernel

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    linears = _fp8_linears(130, 64)
    for lin in linears:
        lin._kernel = fp8_kernel.w8a8_block_fp8_matmul
    x = torch.randn(3, 192, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = [lin(x) for lin in linears]
    stack = stack_linear_weights(linears)
    stack = stack._replace(kernel=fp8_kernel.w8a8_block_fp8_matmul)
    calls = []
    real = fp8_kernel.per_token_group_quant_fp8
    monkeypatch.setattr(
        fp8_kernel, "per_token_group_quant_fp8", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    got = stacked_outputs(x, tuple(linears), stack)
    assert calls == [1]
    for g_, w_ in zip(got, want, strict=True):
        torch.testing.assert_close(g_.float(), w_.float(), rtol=2**-7, atol=2**-7)  # (bf16 outputs)


@pytest.mark.parametrize("why", ["bias", "block", "reduce", "mixed", "switch"])
def test_fp8_linears_that_do_not_stack_are_left_as_they_are(why):
    a, b = _fp8_linears(128, 64)
    if why == "bias":
        b.bias = nn.Parameter(torch.zeros(64))
    elif why == "block":
        b.block = (64, 128)
    elif why == "reduce":
        b.reduce_results = True  # (a row-parallel linear's all-reduce)
    elif why == "mixed":
        b = nn.Linear(192, 64, bias=False)
    assert_left_as_they_are([a, b], switch_off=why == "switch")


def _fp8_moe_block(inter: int = 128, shared_inter: int = 128) -> Qwen3NextSparseMoeBlock:
    """Qwen3-Next's MoE block as an FP8 checkpoint lays it out on CUDA: FP8 experts and shared expert
    (block scales), the router and the shared gate in fp16 (kept dense)."""
    cfg = SimpleNamespace(
        hidden_size=128, num_experts_per_tok=2, num_experts=6, moe_intermediate_size=inter, hidden_act="silu",
        shared_expert_intermediate_size=shared_inter, norm_topk_prob=True,
    )  # fmt: skip
    block = Qwen3NextSparseMoeBlock(cfg)
    g = torch.Generator().manual_seed(3)
    dense = {n: torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5 for n, p in block.named_parameters()}
    mlp = block.shared_expert
    for name in ("gate_proj", "up_proj", "down_proj"):
        old = getattr(mlp, name)
        new = Fp8BlockLinear(old.in_features, old.out_features)
        new.load_dense(dense[f"shared_expert.{name}.weight"])
        setattr(mlp, name, new)
    make_fp8_experts(block.experts, (128, 128))
    for attr in ("w13", "w2"):
        q, s = quantize_block_fp8(dense[f"experts.{attr}"])
        getattr(block.experts, attr).data.copy_(q)
        getattr(block.experts, attr + "_weight_scale_inv").data.copy_(s)
    for lin in (block.gate, block.shared_expert_gate):
        lin.weight.data = dense[[n for n, p in block.named_parameters() if p is lin.weight][0]].half()
    return block


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """The experts' Triton choices made as on CUDA, the kernels interpreted."""
    from sglang.srt.layers.moe import experts as ex

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(ex, "triton_chosen", lambda choice, *a, **k: choice.get() != "torch")
    with envs.SGLANG_GPU_MOE_BACKEND.override("auto"), envs.SGLANG_CPU_MOE_BACKEND.override("torch"):
        yield


def test_the_fp8_shared_expert_runs_as_expert_e_of_the_fp8_experts(triton_on_cpu, monkeypatch):
    """The stacks hold the experts' and the shared expert's bytes and scales (views), every token picks
    expert E with its gate's sigmoid from the routing launch, and the block's output is the layers'
    apart (the shared expert there: its three FP8 linears' block GEMMs, silu * up, the sigmoid-weighted
    add; here inside the FP8 experts' GEMMs and their float32 combine: the same quantized activations,
    fp16 rounding apart)."""
    from sglang.srt.layers.moe import fused_moe_fp8_triton as f8
    from sglang.srt.layers.moe.fp8_fused_experts import Fp8FusedExperts
    from sglang.srt.layers.quantization.fp8_kernel import w8a8_block_fp8_matmul

    fused, apart = _fp8_moe_block(), _fp8_moe_block()
    for block in (fused, apart):
        for lin in (
            block.shared_expert.gate_proj,
            block.shared_expert.up_proj,
            block.shared_expert.down_proj,
        ):
            lin._kernel = w8a8_block_fp8_matmul  # (the block GEMM, activations quantized, as on CUDA)
    mlp = fused.shared_expert
    before = {n: p.detach().clone() for n, p in fused.named_parameters()}
    fused.process_weights_after_loading()
    apart.process_weights_after_loading()
    apart.experts.fused_gemms, apart.shared_routing = None, None  # (the layers apart, as before)
    gemms = fused.experts.fused_gemms
    assert isinstance(gemms, Fp8FusedExperts) and gemms.shared == (mlp, fused.shared_expert_gate)
    assert fused.shared_routing is not None
    w13, s13, w2, s2 = gemms.stack
    assert w13.shape[0] == s13.shape[0] == w2.shape[0] == s2.shape[0] == 7
    for name, p in fused.named_parameters():
        assert p.dtype == before[name].dtype and torch.equal(
            p.view(torch.uint8), before[name].view(torch.uint8)
        ), name
    assert mlp.up_proj.weight.data_ptr() == w13[6, 128].data_ptr()
    assert mlp.up_proj.weight_scale_inv.data_ptr() == s13[6, 1].data_ptr()
    assert (
        mlp.down_proj.weight.data_ptr() == w2[6].data_ptr() and fused.experts.w2.data_ptr() == w2.data_ptr()
    )

    picks, real = [], f8.fused_experts_fp8
    monkeypatch.setattr(
        f8, "fused_experts_fp8", lambda *a, **k: picks.append((a[0].shape, a[6].clone())) or real(*a, **k)
    )
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).half()
    got, want = fused(x), apart(x)
    (shape, ids), _ = picks
    assert shape == (3, 128) and ids.shape == (3, 3) and (ids[:, -1] == 6).all()
    assert_close_to(got, want, TOL_FP16)
    # A shared expert's weights updated in place reach the stacked GEMMs.
    for block in (fused, apart):
        block.shared_expert.down_proj.weight_scale_inv.data.mul_(2)
    assert_close_to(fused(x), apart(x), TOL_FP16)
    # LoRA unfuses a shared expert an adapter changes: the layers apart again, the same output.
    gemms.shared = None
    picks.clear()
    assert_close_to(fused(x), apart(x), TOL_FP16)
    assert picks[0][1].shape == (3, 2)  # the routed experts alone


def test_no_fp8_shared_expert_where_it_is_not_whole_blocks_or_apart(triton_on_cpu):
    """Gate and up ending inside a scale block (intermediate 64: the stack's block would mix them), or
    a shared expert of another width: it stays beside the experts."""
    odd = _fp8_moe_block(inter=64, shared_inter=64)
    odd.process_weights_after_loading()
    assert odd.experts.fused_gemms.shared is None and odd.shared_routing is None
    other = _fp8_moe_block(inter=128, shared_inter=256)
    other.process_weights_after_loading()
    assert other.experts.fused_gemms.shared is None and other.shared_routing is None
    x = torch.randn(2, 128, generator=torch.Generator().manual_seed(5)).half()
    assert torch.isfinite(other(x)).all()
