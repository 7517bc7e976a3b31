"""The block-FP8 dense GEMM through torch's `torch._scaled_mm` with block-wise scales (cuBLAS on Hopper,
CUDA 12.9+): activations scaled per token and 128 columns (1 x 128), weights per 128 x 128 block, as the
published FP8 checkpoints store them. `SGLANG_FP8_GEMM_BACKEND=cublas` gives the dense FP8 linears
`scaled_mm_linear` at load (`fp8.fp8_block_kernel`, where the one-time probe passed): it serves a shape
that fits (K a multiple of 512 and N of 16: every dense projection of the 80B) and hands every other to
the Triton kernel (`fp8_kernel.w8a8_block_fp8_matmul`). The choice is made once, not per call.

Why: on an H200 (2026-11-30) the Triton kernel reached 19-30 % of the FP8 peak at prefill, slower than
bf16's cuBLAS GEMM (0.71-0.89x); issue 53 asks 60 %. Not the default until a GPU measures it
(`benchmark/gpu/bench_fp8_gemm.py`'s `fp8 cublas` column, its GPU test in test_fp8_scaled_mm.py).

The layouts torch checks (ATen's ScaledBlas.cpp, `is_blockwise_1x128_scaling` /
`is_blockwise_128x128_scaling`, with b = weight.t(), checked as b.t() against scale_b.t()): a [M, K]
row-major; scale_a [M, K / 128] column-major (stride (1, M)); scale_b [K / 128, N / 128] whose
transpose is the checkpoint's row-major [N / 128, K / 128] (some versions round that row stride up to a
multiple of 4 blocks: K a multiple of 512 satisfies both). The scales multiply (the checkpoints'
`weight_scale_inv` is the multiplier, despite its name)."""

from __future__ import annotations

import logging

import torch

from sglang.srt.environ import envs
from sglang.srt.utils.device_probe import probed_once

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "triton", "cublas")
# Rows of a call, padded up to a multiple of this: on an H200 (torch 2.11, CUDA 13.0, 2026-12-01) cuBLAS
# found no block-scaled algorithm for one row (CUBLAS_STATUS_NOT_SUPPORTED at N 64-12,288, K 2,048-4,096)
# and ran 32, 64 and 8,192 rows; 32 is the smallest row count seen to run.
ROW_MULTIPLE = 32
_probed: dict[int, bool] = {}  # CUDA device index -> whether torch's block-wise _scaled_mm works there


def chosen() -> bool:
    """Whether SGLANG_FP8_GEMM_BACKEND asks for torch's block-wise `_scaled_mm` (auto: the Triton kernel,
    until a GPU measures the other); a bad value is one sentence naming the variable."""
    value = envs.SGLANG_FP8_GEMM_BACKEND.get()
    if value not in BACKENDS:
        raise ValueError(f"SGLANG_FP8_GEMM_BACKEND must be one of {', '.join(BACKENDS)}; got {value!r}.")
    return value == "cublas"


def fits(m: int, n: int, k: int, block_size) -> bool:
    """Shapes the block-wise `_scaled_mm` takes here: 128 x 128 blocks, K a multiple of 512 (whole scale
    blocks, the scale rows' stride a multiple of 4), N a multiple of 16 (cuBLAS's FP8 alignment), M > 0."""
    return tuple(block_size) == (128, 128) and k % 512 == 0 and n % 16 == 0 and m > 0


def scaled_mm_blockwise(
    a: torch.Tensor, a_scale: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, out_dtype
) -> torch.Tensor:
    """a [M, K] float8_e4m3fn row-major with a_scale [M, K / 128]; weight [N, K] float8_e4m3fn with
    weight_scale [N / 128, K / 128] (row-major, contiguous) -> [M, N] in out_dtype: sum over k of
    a * a_scale * weight * weight_scale, accumulated in float32 (no fast accumulation)."""
    scale_a = a_scale.float().t().contiguous().t()  # [M, K / 128], column-major
    return torch._scaled_mm(
        a, weight.t(), scale_a=scale_a, scale_b=weight_scale.t(), out_dtype=out_dtype, use_fast_accum=False
    )


def scaled_mm_linear(
    a: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size=(128, 128),
    output_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """`fp8_kernel.w8a8_block_fp8_matmul`'s call (a [..., K] in bf16 / fp16 / fp32, quantized here per
    token and 128 columns) through the block-wise `_scaled_mm` where the shape fits, else that kernel."""
    from sglang.srt.layers.quantization import fp8_kernel

    n, k = weight.shape
    lead = a.shape[:-1]
    a2 = a.reshape(-1, k)
    if not fits(a2.shape[0], n, k, block_size):
        return fp8_kernel.w8a8_block_fp8_matmul(a, weight, weight_scale_inv, block_size, output_dtype)
    m = a2.shape[0]
    padded = -(-m // ROW_MULTIPLE) * ROW_MULTIPLE
    if padded != m:  # (zero rows: their outputs are dropped)
        a2 = torch.nn.functional.pad(a2, (0, 0, 0, padded - m))
    q, scale = fp8_kernel.per_token_group_quant_fp8(a2, block_size[1])
    out = scaled_mm_blockwise(q, scale, weight, weight_scale_inv, output_dtype)
    return out[:m].view(*lead, n)


def available(device: torch.device) -> bool:
    """Whether torch's block-wise `_scaled_mm` runs on `device` and agrees with dequantize-then-matmul
    (checked once per device, at load; a CUDA graph must not capture the check): torch older than the
    block-wise scales, CUDA before 12.9, a GPU cuBLAS has no such kernel for, or scales read in another
    layout each turn it off with one warning."""
    return probed_once(_probed, device, _probe)


def _probe(device: torch.device) -> bool:
    from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, dequantize_block_fp8

    g = torch.Generator(device=device).manual_seed(0)
    m, n, k = 32, 256, 1024
    a = (torch.randn(m, k, device=device, generator=g) * 50).to(FP8_DTYPE)
    w = (torch.randn(n, k, device=device, generator=g) * 50).to(FP8_DTYPE)
    a_s = torch.rand(m, k // 128, device=device, generator=g) + 0.5
    w_s = torch.rand(n // 128, k // 128, device=device, generator=g) + 0.5
    try:
        got = scaled_mm_blockwise(a, a_s, w, w_s, torch.float32)
    except Exception as e:  # noqa: BLE001 - any refusal means the Triton kernel serves
        logger.warning("SGLANG_FP8_GEMM_BACKEND=cublas: torch's block-wise _scaled_mm is unavailable here "
                       "(%s: %s); the Triton block-FP8 GEMM serves.", type(e).__name__, str(e)[:200])  # fmt: skip
        return False
    want = dequantize_block_fp8(a, a_s, (1, 128)) @ dequantize_block_fp8(w, w_s).t()
    # Same products summed in another order in float32: far under 1e-3 of the magnitude; a scale read
    # in another layout is O(1) off.
    magnitude = dequantize_block_fp8(a, a_s, (1, 128)).abs() @ dequantize_block_fp8(w, w_s).abs().t()
    if not bool(((got - want).abs() <= 1e-3 * magnitude).all()):
        logger.warning("SGLANG_FP8_GEMM_BACKEND=cublas: torch's block-wise _scaled_mm disagrees with "
                       "dequantize-then-matmul on this device; the Triton block-FP8 GEMM serves.")  # fmt: skip
        return False
    return True
