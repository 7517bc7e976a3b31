"""The split-K block-FP8 GEMM (decode's table row, `fp8_kernel._gemm_split_k_kernel`; issue 53, review
item 6): under `TRITON_INTERPRET=1` against the torch twin with uneven parts and partial blocks, and
compiled for sm_90 without spills. Nightly: the per-commit file (test_fp8_gemm_triton.py) checks the
split's choice by shape, and on a GPU its real-shape test at M = 1 runs the split."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.quantization import fp8_kernel as fk
from sglang.test.ci_register import register_cpu_ci
from sglang.test.sm90 import compile_sm90_in_registers

register_cpu_ci(est_time=4, suite="nightly-cpu")

# Interpreted float32 sums of the same products in another order (per part, per block): under 2^-16 of
# the sum of the terms' magnitudes (test_fp8_gemm_triton.py's SUM_TOL, which says why).
SUM_TOL = 2**-16


def _operands(m: int, n: int, k: int, seed: int):
    """Activations with columns of very different magnitudes; a weight over e4m3's range with one
    positive scale per block."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(fk.FP8_DTYPE)
    return a, w, torch.rand(-(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4


@pytest.mark.parametrize(
    "m,n,k,split_k",
    [
        (1, 200, 640, 2),  # 5 K blocks in parts of 3 and 2; N a partial tile
        (4, 130, 520, 3),  # parts of 2, 2, 1; K not a multiple of 128: the last block partial
        (5, 64, 384, 0),  # auto (from any K here): one tile, so one block per part
    ],
)
def test_split_k_equals_the_twin(interpret, monkeypatch, m, n, k, split_k):
    """The split-K GEMM (decode's table row) against the twin: each part's float32 partial tile summed
    after, so the same products summed in another order (`SUM_TOL`); a part covering no whole block
    count, or one off the scale grid, would be O(1) off."""
    monkeypatch.setattr(fk, "SPLIT_K_MIN_K", 0)  # (the server splits from K 4,096; small shapes here)
    a, w, scale = _operands(m, n, k, seed=m + n + k)
    cfg = fk.GemmConfig(16, 64, 128, 1, 4, 4, split_k=split_k)
    assert fk.split_k_for(cfg, m, n, k, a.device)  # (the split path runs)
    got = fk.w8a8_block_fp8_matmul(a, w, scale, output_dtype=torch.float32, config=cfg)
    want = fk.w8a8_block_fp8_matmul_torch(a, w, scale, output_dtype=torch.float32)
    aq, a_s = fk.per_token_group_quant_fp8_torch(a)
    a_deq, w_deq = fk.dequantize_block_fp8(aq, a_s, (1, 128)), fk.dequantize_block_fp8(w, scale)
    magnitude = a_deq.abs().double() @ w_deq.abs().double().t()
    assert ((got.double() - want.double()).abs() <= SUM_TOL * magnitude).all()


def test_split_k_compiles_for_sm90():
    """The split-K kernel with decode's tile compiles for sm_90 on fp8 operands, pipelined, without
    spilling."""
    cfg = fk.gemm_config(1)
    signature = {
        "a_ptr": "*fp8e4nv", "as_ptr": "*fp32", "b_ptr": "*fp8e4nv", "bs_ptr": "*fp32", "p_ptr": "*fp32",
        **{name: "i32" for name in ("M", "N", "K", "K_SPLIT", "a_stride", "AS_COLS", "BS_COLS")},
        **{name: "constexpr" for name in ("SCALE_N", "SCALE_K", "BLOCK_M", "BLOCK_N", "BLOCK_K")},
    }  # fmt: skip
    constexprs = dict(SCALE_N=128, SCALE_K=128, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    compiled = compile_sm90_in_registers(
        fk._gemm_split_k_kernel, signature, constexprs, ("N", "K", "K_SPLIT", "a_stride"),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    assert compiled.metadata.shared >= (cfg.num_stages - 1) * (cfg.block_m + cfg.block_n) * cfg.block_k
    assert "e4m3" in compiled.asm["ptx"]
