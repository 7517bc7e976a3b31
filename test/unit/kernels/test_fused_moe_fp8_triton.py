"""The FP8 routed experts (layers/moe/fused_moe_fp8_triton.py): the grouped block-FP8 GEMMs under
`TRITON_INTERPRET=1` against their torch twin (partial blocks, empty experts, both bookkeeping paths),
the twin against the dense GEMM's twin per assignment, the seam in `RoutedExperts` that picks them by
the weights' dtype, and every tile of the table compiled for sm_90 without spills."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.moe import fused_moe_fp8_triton as mf
from sglang.srt.layers.quantization import fp8_kernel as fk
from sglang.test.ci_register import register_cpu_ci
from sglang.test.sm90 import compile_sm90_in_registers

register_cpu_ci(est_time=16, suite="per-commit-cpu")


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    gate, up = h.chunk(2, -1)
    return F.silu(gate) * up


def _experts(e: int, hidden: int, inter: int, seed: int):
    """w13 [E, 2I, H] and w2 [E, H, I] in fp8 with block scales sized so that outputs stay O(1)."""
    g = torch.Generator().manual_seed(seed)

    def one(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = (torch.randn(e, n, k, generator=g) * 64).clamp(-448, 448).to(fk.FP8_DTYPE)
        scale = (torch.rand(e, -(-n // 128), -(-k // 128), generator=g) + 0.5) / (64 * k**0.5)
        return w, scale

    return (*one(2 * inter, hidden), *one(hidden, inter))


def _routing(tokens: int, top_k: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=g), ids


# (tokens, top_k, experts, hidden, intermediate): partial 128-blocks in H and I, experts left unused.
CASES = [(1, 2, 4, 64, 64), (5, 3, 8, 200, 100), (33, 2, 6, 128, 256)]


@pytest.mark.parametrize("silu_and_mul", [False, True], ids=["activate", "fused-silu"])
@pytest.mark.parametrize("tokens,top_k,e,hidden,inter", CASES)
def test_kernels_equal_the_twin(kernel_device, tokens, top_k, e, hidden, inter, silu_and_mul):
    """float32 activations, quantized by both paths to the same fp8 bits (the kernel's quantization is
    the twin's bit for bit), so the outputs differ by the rounding of the sums (per block here, once
    there; the combine in another order): ~1e-6 relative interpreted. The bound, 2^-12 of the outputs'
    O(1) scale, leaves room for h's rounding to move one activation across an e4m3 rounding boundary
    (one e4m3 step, 2^-3 of one term of I), and is far below a wrong expert, row, block scale or weight.
    Compiled on Hopper, 2^-8: its FP8 tensor cores accumulate with fewer bits inside each 128-long dot
    (test_fp8_gemm_triton.SUM_TOL: up to 2^-10 of the terms' magnitudes, which exceed the outputs by
    about sqrt(K))."""
    w13, s13, w2, s2 = (t.to(kernel_device) for t in _experts(e, hidden, inter, seed=tokens))
    weights, ids = (t.to(kernel_device) for t in _routing(tokens, top_k, e, seed=tokens))
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(1)).to(kernel_device)
    got = mf.fused_experts_fp8(x, w13, s13, w2, s2, weights, ids, _silu_mul, silu_and_mul=silu_and_mul)
    want = mf.fused_experts_fp8_torch(x, w13, s13, w2, s2, weights, ids, _silu_mul)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert want.abs().max() > 0.1  # outputs of O(1): the bound below is relative to them
    tol = 2**-12 if kernel_device == "cpu" else 2**-8
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())


def test_prefill_sized_batches_take_the_sort_and_agree(interpret, monkeypatch):
    """Above the Triton bookkeeping's size (ALIGN_MAX_ASSIGNMENTS, lowered here) the assignments are
    sorted by torch and combined by the torch loop over the picks: the same result as the twin, within the
    bound above."""
    from sglang.srt.layers.moe import sort_combine

    monkeypatch.setattr(sort_combine, "ALIGN_MAX_ASSIGNMENTS", 4)
    w13, s13, w2, s2 = _experts(5, 128, 128, seed=2)
    weights, ids = _routing(9, 2, 5, seed=3)
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4))
    got = mf.fused_experts_fp8(x, w13, s13, w2, s2, weights, ids, _silu_mul)
    want = mf.fused_experts_fp8_torch(x, w13, s13, w2, s2, weights, ids, _silu_mul)
    torch.testing.assert_close(got, want, rtol=2**-12, atol=2**-12 * want.abs().max().item())


def test_twin_is_the_dense_twin_per_assignment():
    """Each token's output is the sum over its experts of weight x the dense block-FP8 twin twice
    (w13, activation, w2): the MoE's semantics are the dense GEMM's, checked against float64 there."""
    w13, s13, w2, s2 = _experts(4, 200, 100, seed=5)
    weights, ids = _routing(3, 2, 4, seed=6)
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(7))
    got = mf.fused_experts_fp8_torch(x, w13, s13, w2, s2, weights, ids, _silu_mul)
    for t in range(3):
        want = torch.zeros(200)
        for j, expert in enumerate(ids[t].tolist()):
            h = fk.w8a8_block_fp8_matmul_torch(
                x[t : t + 1], w13[expert], s13[expert], output_dtype=torch.float32
            )
            y = fk.w8a8_block_fp8_matmul_torch(
                _silu_mul(h), w2[expert], s2[expert], output_dtype=torch.float32
            )
            want += weights[t, j] * y[0]
        torch.testing.assert_close(got[t], want, rtol=1e-6, atol=1e-6)  # the same float32 ops, regrouped


def test_the_experts_pick_fp8_by_their_weights_dtype(interpret, monkeypatch):
    """`RoutedExperts` with float8_e4m3fn weights and their block scales runs the FP8 kernels where its
    Triton path serves and their twin where it does not; the two agree; bfloat16 weights never take it."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.moe.experts import RoutedExperts

    calls = []
    for name in ("fused_experts_fp8", "fused_experts_fp8_torch"):
        real = getattr(mf, name)
        spy = lambda *a, _real=real, _name=name, **kw: calls.append((_name, kw)) or _real(*a, **kw)  # noqa: E731
        monkeypatch.setattr(mf, name, spy)
    w13, s13, w2, s2 = _experts(4, 128, 64, seed=8)
    weights, ids = _routing(5, 2, 4, seed=9)
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(10))
    outs = {}
    for backend in ("triton", "torch"):
        layer = RoutedExperts(4, 128, 64, "silu", gated=True)
        layer.w13.data, layer.w2.data = w13, w2
        layer.w13_weight_scale_inv, layer.w2_weight_scale_inv = s13, s2
        with envs.SGLANG_GPU_MOE_BACKEND.override(backend), envs.SGLANG_CPU_MOE_BACKEND.override("auto"):
            layer.process_weights_after_loading()
        assert layer.fp8 and layer.cpu_ops is None  # the C++ op takes float weights only
        outs[backend] = layer(x, weights, ids)
    # Gated silu experts: the activation computed inside the second quantization's launch.
    assert calls == [("fused_experts_fp8", {"silu_and_mul": True}), ("fused_experts_fp8_torch", {})]
    torch.testing.assert_close(
        outs["triton"], outs["torch"], rtol=2**-12, atol=2**-12 * outs["torch"].abs().max().item()
    )
    assert not RoutedExperts(4, 128, 64, "silu", gated=True).fp8


@pytest.mark.parametrize("e", [1, 5, 64, 200, 512])
def test_tile_map_equals_its_twin(kernel_device, e):
    """The cumulative tiles per expert over one chunk, several chunks and a partial last one, with empty
    experts and experts of exactly one tile, at each tile height of the table."""
    g = torch.Generator().manual_seed(e)
    counts = torch.randint(0, 40, (e,), generator=g) * (torch.rand(e, generator=g) < 0.7)
    offs = torch.cumsum(counts, 0).to(torch.int32).to(kernel_device)
    for cfg in {cfg for _, cfg in mf.MOE_GEMM_CONFIGS}:
        assert torch.equal(mf.tile_map(offs, cfg.block_m), mf.tile_map_torch(offs, cfg.block_m))


def test_an_empty_batch(interpret):
    w13, s13, w2, s2 = _experts(4, 64, 64, seed=11)
    out = mf.fused_experts_fp8(
        torch.zeros(0, 64),
        w13,
        s13,
        w2,
        s2,
        torch.zeros(0, 2),
        torch.zeros(0, 2, dtype=torch.int64),
        _silu_mul,
    )
    assert out.shape == (0, 64)


MOE_SIGNATURE = {
    "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "c_ptr": "*bf16",
    "token_ptr": "*i64", "offs_ptr": "*i32", "tile_end_ptr": "*i32",
    **{name: "i32" for name in ("N", "K", "a_stride", "AS_COLS", "BS_COLS", "b_expert_stride", "bs_expert_stride")},
    **{name: "constexpr" for name in ("E", "E_POW2", "GATHER", "SCALE_N", "SCALE_K", "BLOCK_M", "BLOCK_N", "BLOCK_K",
                                      "FP8", "SILU_MUL", "RELU2")},
}  # fmt: skip


@pytest.mark.parametrize(
    "cfg", [cfg for _, cfg in mf.MOE_GEMM_CONFIGS], ids=lambda c: f"{c.block_m}x{c.block_n}"
)
@pytest.mark.parametrize("gather", [True, False], ids=["w13", "w2"])
def test_moe_gemm_compiles_for_sm90(cfg, gather):
    """Qwen3-Next-80B's experts (512, w13 rows gathered by token, w2 rows in sorted order): every tile of
    the table compiles for sm_90, pipelined, without spills (N, K and the strides multiples of 16 there)."""
    constexprs = dict(E=512, E_POW2=512, GATHER=gather, SCALE_N=128, SCALE_K=128,
                      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FP8=True,
                      SILU_MUL=False, RELU2=False)  # fmt: skip
    compiled = compile_sm90_in_registers(
        mf._moe_gemm_kernel, MOE_SIGNATURE, constexprs, ("N", "K", "a_stride", "b_expert_stride"),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    assert "e4m3" in ptx
    assert ("wgmma" in ptx) == (cfg.block_m >= 64)  # Hopper's warp-group MMA where the tile has 64 rows
    assert compiled.metadata.shared >= (cfg.num_stages - 1) * (cfg.block_m + cfg.block_n) * cfg.block_k


def test_tile_map_compiles_for_sm90():
    signature = {
        "offs_ptr": "*i32",
        "tile_end_ptr": "*i32",
        "E": "i32",
        "BLOCK_M": "constexpr",
        "BE": "constexpr",
    }
    compile_sm90_in_registers(mf._tile_map_kernel, signature, dict(BLOCK_M=16, BE=mf._TILE_MAP_BE))



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", [1, 64, 256, 1024])
def test_gpu_experts_at_the_80b_shapes(tokens):
    """Qwen3-Next-80B's experts (512, top 10, hidden 2,048, width 512) compiled on the GPU in bfloat16
    against the twin. h is rounded to bf16 in both, from float32 sums taken in other orders, so an
    element can land one bf16 step (2^-8) apart and its e4m3 rounding one step apart (2^-3 of one of 512
    terms) before the output's own bf16 rounding (2^-8): 2^-6 of the outputs' scale holds a few such
    and is far below a wrong expert, row or scale (O(1))."""
    e, hidden, inter, top_k = 512, 2048, 512, 10
    g = torch.Generator(device="cuda").manual_seed(tokens)
    w13 = (torch.randn(e, 2 * inter, hidden, device="cuda", generator=g, dtype=torch.bfloat16) * 64).to(
        fk.FP8_DTYPE
    )
    w2 = (torch.randn(e, hidden, inter, device="cuda", generator=g, dtype=torch.bfloat16) * 64).to(
        fk.FP8_DTYPE
    )
    s13 = (torch.rand(e, 2 * inter // 128, hidden // 128, device="cuda", generator=g) + 0.5) / (
        64 * hidden**0.5
    )
    s2 = (torch.rand(e, hidden // 128, inter // 128, device="cuda", generator=g) + 0.5) / (64 * inter**0.5)
    x = torch.randn(tokens, hidden, device="cuda", generator=g).to(torch.bfloat16)
    ids = torch.rand(tokens, e, device="cuda", generator=g).topk(top_k, dim=1).indices
    weights = torch.rand(tokens, top_k, device="cuda", generator=g)
    got = mf.fused_experts_fp8(x, w13, s13, w2, s2, weights, ids, _silu_mul)
    want = mf.fused_experts_fp8_torch(x, w13, s13, w2, s2, weights, ids, _silu_mul)
    scale = want.float().abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2**-6 * scale)
