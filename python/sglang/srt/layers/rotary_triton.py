"""Rotary position embedding of q and k in one Triton launch, the CUDA path of `layers/rotary_embedding.py`
(neox style, partial rotary): the torch form takes ~14 kernels per attention layer (casts, cos/sin, slices,
products, a concatenation). The arithmetic is the torch form's operations: cos and sin of position x
inverse frequency in float32, the rotation in float32, one rounding to the activation dtype (a GPU's
intrinsics may differ from torch's by an ulp or two). On CPU tensors the
kernel runs only under `TRITON_INTERPRET=1`, for tests.

With `norms` (Qwen3-Next's q_norm and k_norm: an RMSNorm per head, weight offset by one) the same launch
normalises each head first, as `rmsnorm_triton`'s PLAIN mode does (float32 statistics over the head, the
product with the weight rounded once to the activation dtype), then rotates the rounded values: one
launch where the norms and the rotation took three per attention layer.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.triton_jit import add, jit_for_env


def _rope_kernel(
    pos_ptr,
    inv_freq_ptr,
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    k_stride_h,
    qw_ptr,
    kw_ptr,
    q_eps,
    k_eps,
    HQ: tl.constexpr,
    HK: tl.constexpr,
    D: tl.constexpr,
    HALF: tl.constexpr,
    BHALF: tl.constexpr,
    BREST: tl.constexpr,
    NORM: tl.constexpr,
    W_OFFSET: tl.constexpr,
    BD: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)  # q heads first, then k heads
    if h < HQ:
        src = q_ptr + t * q_stride_t + h * q_stride_h
        dst = q_out_ptr + (t * HQ + h) * D
        w_ptr, eps = qw_ptr, q_eps
    else:
        src = k_ptr + t * k_stride_t + (h - HQ) * k_stride_h
        dst = k_out_ptr + (t * HK + h - HQ) * D
        w_ptr, eps = kw_ptr, k_eps
    act = q_out_ptr.dtype.element_ty
    i = tl.arange(0, BHALF)
    mi = i < HALF
    freq = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + i, mask=mi, other=0.0).to(tl.float32)
    cos, sin = tl.cos(freq), tl.sin(freq)
    x1 = tl.load(src + i, mask=mi, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=mi, other=0.0).to(tl.float32)
    if NORM:  # the head's RMSNorm first (the PLAIN norm's arithmetic: (x * rstd) * w), its result rounded
        d = tl.arange(0, BD)
        x = tl.load(src + d, mask=d < D, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.reduce(x * x, 0, add) / D + eps)
        w1 = tl.load(w_ptr + i, mask=mi, other=0.0).to(tl.float32) + W_OFFSET
        w2 = tl.load(w_ptr + HALF + i, mask=mi, other=0.0).to(tl.float32) + W_OFFSET
        x1 = ((x1 * rstd) * w1).to(act).to(tl.float32)
        x2 = ((x2 * rstd) * w2).to(act).to(tl.float32)
    tl.store(dst + i, (x1 * cos - x2 * sin).to(act), mask=mi)
    tl.store(dst + HALF + i, (x2 * cos + x1 * sin).to(act), mask=mi)
    if BREST > 0:  # channels past the rotary ones pass through (normalised first with NORM)
        r = 2 * HALF + tl.arange(0, BREST)
        mr = r < D
        rest = tl.load(src + r, mask=mr, other=0.0)
        if NORM:
            w_rest = tl.load(w_ptr + r, mask=mr, other=0.0).to(tl.float32) + W_OFFSET
            rest = (rest.to(tl.float32) * rstd) * w_rest
        tl.store(dst + r, rest.to(act), mask=mr)


def rotary_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    inv_freq: torch.Tensor,
    rotary_dim: int,
    norms: tuple[tuple[torch.Tensor, float], tuple[torch.Tensor, float], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hk, D] (heads and tokens may be strided, channels contiguous) rotated at
    `positions` [T] over their first `rotary_dim` channels: new contiguous tensors of their dtype.
    `norms`: ((q's norm weight [D], eps), (k's, eps), offset_one): each head normalised first."""
    t, hq, d = q.shape
    hk = k.shape[1]
    assert q.dtype == k.dtype, "q and k share one dtype"
    q = q if q.stride(-1) == 1 else q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    q_out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    k_out = torch.empty(t, hk, d, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    half = rotary_dim // 2
    (qw, q_eps), (kw, k_eps), offset_one = norms or ((inv_freq, 0.0), (inv_freq, 0.0), False)
    jit_for_env(_rope_kernel)[(t, hq + hk)](
        positions.contiguous(), inv_freq, q, k, q_out, k_out, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        qw, kw, q_eps, k_eps,
        HQ=hq, HK=hk, D=d, HALF=half, BHALF=triton.next_power_of_2(half),
        BREST=triton.next_power_of_2(d - rotary_dim) if d > rotary_dim else 0,
        NORM=norms is not None, W_OFFSET=1.0 if offset_one else 0.0, BD=triton.next_power_of_2(d),
    )  # fmt: skip
    return q_out, k_out
