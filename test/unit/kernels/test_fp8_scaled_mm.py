"""The block-FP8 dense GEMM through torch's block-wise `torch._scaled_mm` (SGLANG_FP8_GEMM_BACKEND=cublas,
layers/quantization/fp8_scaled_mm.py). CPU torch has no block-wise `_scaled_mm`, so on CPU an emulator
stands in for it that refuses any layout ATen's checks refuse (ScaledBlas.cpp: 1 x 128 scales of a
column-major, 128 x 128 scales of b.t() row-major) and computes dequantize-then-matmul: the dispatch, the
layouts handed over, the fallback and the load-time probe. On a GPU (marked gpu): the real call at the
80B's shapes against the twin."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.quantization import fp8_kernel as fk
from sglang.srt.layers.quantization import fp8_scaled_mm as sm
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

# Interpreted / emulated float32 sums of the same products in another order: under 2^-16 of the sum of
# the terms' magnitudes (test_fp8_gemm_triton.py's SUM_TOL says why); on Hopper the tensor cores' FP8
# accumulation keeps fewer bits inside each 128-long block (its "cuda" value, 2^-10).
SUM_TOL = {"cpu": 2**-16, "cuda": 2**-10}


def _emulated_scaled_mm(calls: list, transpose_b_scales: bool = False):
    def scaled_mm(a, b, scale_a, scale_b, out_dtype, use_fast_accum):
        m, k = a.shape
        n = b.shape[1]
        kb = -(-k // 128)
        assert a.dtype == b.dtype == fk.FP8_DTYPE and a.stride() == (k, 1), "a: row-major float8"
        assert b.stride() == (1, k), "b: column-major (the weight [N, K] row-major, transposed)"
        assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m), "1 x 128: column-major scales"
        assert scale_b.t().shape == (-(-n // 128), kb) and scale_b.t().stride() == (kb, 1), "128 x 128"
        assert scale_a.dtype == scale_b.dtype == torch.float32 and not use_fast_accum
        # (an H200's cuBLAS found no algorithm for one row: callers pad the rows)
        assert m % sm.ROW_MULTIPLE == 0, f"{m} rows: cuBLAS may have no algorithm for them"
        calls.append((m, n, k))
        w_scale = scale_b if transpose_b_scales else scale_b.t()  # (a layout misread, for the probe)
        if transpose_b_scales:
            w_scale = w_scale.reshape(scale_b.t().shape)
        a_deq = fk.dequantize_block_fp8(a, scale_a.contiguous(), (1, 128))
        return (a_deq @ fk.dequantize_block_fp8(b.t(), w_scale.contiguous()).t()).to(out_dtype)

    return scaled_mm


def _operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * torch.logspace(-2, 1, k)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(fk.FP8_DTYPE)
    return a, w, torch.rand(-(-n // 128), -(-k // 128), generator=g) * 1e-3 + 1e-4


def test_cublas_serves_the_shapes_that_fit_and_triton_the_rest(interpret, monkeypatch):
    """With SGLANG_FP8_GEMM_BACKEND=cublas and the probe passed, an FP8 linear is given
    `scaled_mm_linear` at load (auto: the Triton kernel); it sends a GEMM whose K is a multiple of 512
    and N of 16 to `_scaled_mm` with the layouts ATen checks, K 640 to the Triton kernel, and equals
    the twin either way."""
    from sglang.srt.layers.quantization.fp8 import fp8_block_kernel

    calls: list = []
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm(calls))
    monkeypatch.setattr(sm, "available", lambda device: True)
    cuda = torch.device("cuda")  # (where the load looks the kernel up; nothing runs there)
    with envs.SGLANG_FP8_GEMM_BACKEND.override("auto"):
        assert fp8_block_kernel(cuda) is fk.w8a8_block_fp8_matmul
    with envs.SGLANG_FP8_GEMM_BACKEND.override("cublas"):
        gemm = fp8_block_kernel(cuda)
    assert gemm is sm.scaled_mm_linear
    for m, n, k, served in ((5, 256, 1024, True), (3, 64, 512, True), (5, 256, 640, False)):  # (N 64: in_proj_ba)
        a, w, scale = _operands(m, n, k, seed=m + n + k)
        calls.clear()
        got = gemm(a[None], w, scale, [128, 128], torch.float32)[0]  # (leading dims kept)
        assert calls == ([(sm.ROW_MULTIPLE, n, k)] if served else []), (m, n, k)  # (rows padded)
        want = fk.w8a8_block_fp8_matmul_torch(a, w, scale, output_dtype=torch.float32)
        aq, a_s = fk.per_token_group_quant_fp8_torch(a)
        magnitude = fk.dequantize_block_fp8(aq, a_s, (1, 128)).abs().double() @ (
            fk.dequantize_block_fp8(w, scale).abs().double().t()
        )
        assert ((got.double() - want.double()).abs() <= SUM_TOL["cpu"] * magnitude).all()


def test_the_probe_turns_it_off_where_it_fails_or_disagrees(monkeypatch, caplog):
    """The load-time probe: a working `_scaled_mm` passes; one that raises (torch or CUDA too old) or
    reads the weight scales in another layout (O(1) off) turns the backend off with one warning each."""
    cpu = torch.device("cpu")
    monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm([]))
    assert sm._probe(cpu)

    def refuses(*args, **kwargs):
        raise RuntimeError("Invalid scaling configuration")

    with caplog.at_level(logging.WARNING, logger=sm.__name__):
        monkeypatch.setattr(torch, "_scaled_mm", refuses)
        assert not sm._probe(cpu)
        monkeypatch.setattr(torch, "_scaled_mm", _emulated_scaled_mm([], transpose_b_scales=True))
        assert not sm._probe(cpu)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and "unavailable here (RuntimeError" in messages[0] and "disagrees" in messages[1]
    assert all("the Triton block-FP8 GEMM serves" in m for m in messages)
    assert not sm.available(cpu)  # (CPU tensors never: no block-wise _scaled_mm there)


def test_a_bad_backend_value_is_one_sentence():
    with envs.SGLANG_FP8_GEMM_BACKEND.override("cutlass"), pytest.raises(ValueError) as err:
        sm.chosen()
    assert str(err.value) == "SGLANG_FP8_GEMM_BACKEND must be one of auto, triton, cublas; got 'cutlass'."


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 64, 8192])
@pytest.mark.parametrize("n,k", [(12288, 2048), (64, 2048), (2048, 4096), (8192, 2048)])
def test_gpu_scaled_mm_at_real_shapes(m, n, k):
    """torch's block-wise `_scaled_mm` on this GPU (the probe passes: it runs and reads the scales as
    ATen documents) against the twin's float32 result: one bf16 rounding of the output plus the FP8
    tensor cores' summation (`SUM_TOL`)."""
    assert sm.available(torch.device("cuda")), "torch's block-wise _scaled_mm does not run here (see the log)"
    torch.manual_seed(m + n + k)
    a = (torch.randn(m, k, device="cuda") * torch.logspace(-2, 1, k, device="cuda")).to(torch.bfloat16)
    w = (torch.randn(n, k, device="cuda") * 100).clamp(-448, 448).to(fk.FP8_DTYPE)
    scale = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3 + 1e-4
    got = sm.scaled_mm_linear(a, w, scale, (128, 128), torch.bfloat16)
    want = fk.w8a8_block_fp8_matmul_torch(a, w, scale, output_dtype=torch.float32).double()
    q, s = fk.per_token_group_quant_fp8(a)
    magnitude = fk.dequantize_block_fp8(q, s, (1, 128)).abs().double() @ (
        fk.dequantize_block_fp8(w, scale).abs().double().t()
    )
    assert ((got.double() - want).abs() <= 2**-9 * want.abs() + SUM_TOL["cuda"] * magnitude).all()
