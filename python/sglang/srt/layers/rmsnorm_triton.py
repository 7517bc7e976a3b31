"""The RMSNorm family (`layers/layernorm.py`) in one Triton kernel each call, the CUDA path: the torch
form takes 8-10 kernels per norm (casts, pow, mean, add, rsqrt, muls), about a third of a tiny decode
step's ~450 launches (`benchmark/gpu/kernel_census.py`). The arithmetic is the torch form's operations in
its order: float32 statistics, and the same roundings to the activation dtype where the torch form rounds
(a GPU's exp / sqrt / divide intrinsics may differ from torch's by an ulp or two, which can move a
bfloat16 rounding by one step).

Modes (`MODE`), per row of x [M, N], normalised per group of G channels (G = N unless grouped):
- PLAIN:      out = norm(x) * (w [+ 1 with OFFSET_ONE])                       (RMSNorm)
- GATE_AFTER: out = round(w * round(norm(x))) * silu(gate)                    (GatedRMSNorm, Qwen3-Next)
- GATE_FIRST: out = w * round(norm(x * silu(gate)))                           (GroupedGatedRMSNorm, Nemotron-H)
where round() is the cast to the activation dtype the torch form makes (a no-op in float32). With
`residual` (PLAIN only: `add_rmsnorm_triton`, upstream's fused add-RMSNorm) x is first replaced by
round(x + residual), which the kernel also writes out: the decoder layer's residual add and the next
norm in one launch instead of two. On CPU tensors the kernel runs only under `TRITON_INTERPRET=1`, for
tests.

Rows are addressed as (token, head) with a stride each: a per-head norm of [T, H, D] views cut out of a
wider projection (Qwen3-Next's q beside its output gate, k and z out of a stacked GEMM's product:
`stacked_linears.py`) reads them in place, where flattening them to [T H, D] rows would copy them first
(one launch more per norm at batches over one).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.triton_jit import add, jit_for_env

PLAIN, GATE_AFTER, GATE_FIRST = 0, 1, 2


def _rmsnorm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    res_ptr,
    sum_ptr,
    x_stride,
    gate_stride,
    res_stride,
    x_hstride,
    gate_hstride,
    heads,
    eps,
    N: tl.constexpr,
    G: tl.constexpr,
    BG: tl.constexpr,
    MODE: tl.constexpr,
    OFFSET_ONE: tl.constexpr,
    ROUND_PRODUCT: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    token, head = row // heads, row % heads  # (x and gate: [tokens, heads, N] with strides of their own)
    x_row = x_ptr + token * x_stride + head * x_hstride
    gate_row = gate_ptr + token * gate_stride + head * gate_hstride
    offs = tl.program_id(1) * G + tl.arange(0, BG)
    mask = tl.arange(0, BG) < G
    act = x_ptr.dtype.element_ty  # the torch form's roundings are to x's dtype
    x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(act)  # torch's add of two activations: float32 arithmetic, one rounding
        tl.store(sum_ptr + row * N + offs, s, mask=mask)
        x = s.to(tl.float32)
    if MODE == 2:
        g = tl.load(gate_row + offs, mask=mask, other=0.0).to(tl.float32)
        x = x * (g / (1.0 + tl.exp(-g)))
    n = x * (1.0 / tl.sqrt(tl.reduce(x * x, 0, add) / G + eps))
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if MODE == 0:
        if OFFSET_ONE:
            w = w + 1.0
        y = n * w
    elif MODE == 1:
        y = w * n.to(act).to(tl.float32)
        if ROUND_PRODUCT:
            y = y.to(act).to(tl.float32)
        g = tl.load(gate_row + offs, mask=mask, other=0.0).to(tl.float32)
        y = y * (g / (1.0 + tl.exp(-g)))
    else:
        y = w * n.to(act).to(tl.float32)
    tl.store(out_ptr + row * N + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def rmsnorm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    mode: int = PLAIN,
    gate: torch.Tensor | None = None,
    group_size: int | None = None,
    offset_one: bool = False,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The norm of x over its last dim (in groups of `group_size`), in one launch; the result has x's
    shape and `out_dtype` (the torch form's result dtype: x's, or its promotion with the weight's)."""
    n = x.shape[-1]
    g = group_size or n
    heads = x.shape[-2] if x.dim() >= 3 else 1
    x3 = _token_head_rows(x, heads)
    gate3 = None if gate is None else _token_head_rows(gate.reshape(x.shape), heads)
    out = torch.empty(x3.shape[0] * heads, n, dtype=out_dtype or x.dtype, device=x.device)
    _launch(x3, gate3, weight, out, None, None, eps, mode, g, offset_one)
    return out.view(x.shape)


def _token_head_rows(t: torch.Tensor, heads: int) -> torch.Tensor:
    """t as [tokens, heads, N] with a unit last stride: a view where the leading dims merge (a [T, H, N]
    tensor is itself, however strided), else a copy."""
    t3 = t.reshape(-1, heads, t.shape[-1])
    return t3 if t3.stride(-1) == 1 else t3.contiguous()


def add_rmsnorm_triton(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, offset_one: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(norm(residual + x) * weight, residual + x) in one launch, the sum rounded to x's dtype as torch's
    add rounds it (x and residual of one shape and dtype; the norm's dtype is x's)."""
    assert x.shape == residual.shape and x.dtype == residual.dtype, "x and residual: one shape, one dtype"
    n = x.shape[-1]
    x2, r2 = x.reshape(-1, n), residual.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if r2.stride(-1) != 1:
        r2 = r2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    total = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    _launch(x2[:, None], None, weight, out, r2, total, eps, PLAIN, n, offset_one)
    return out.view(x.shape), total.view(x.shape)


def _launch(x3, gate3, weight, out, res2, total, eps, mode, g, offset_one) -> None:
    """x3 (and gate3) [tokens, heads, N] with unit last strides; out (and res2, total) [tokens heads, N]."""
    tokens, heads, n = x3.shape
    if not tokens * heads:
        return
    gate_strides = (gate3.stride(0), gate3.stride(1)) if gate3 is not None else (0, 0)
    jit_for_env(_rmsnorm_kernel)[(tokens * heads, n // g)](
        x3, gate3 if gate3 is not None else x3, weight, out, res2 if res2 is not None else x3,
        total if total is not None else out, x3.stride(0), gate_strides[0],
        res2.stride(0) if res2 is not None else 0, x3.stride(1), gate_strides[1], heads, eps,
        N=n, G=g, BG=triton.next_power_of_2(g), MODE=mode, OFFSET_ONE=offset_one,
        ROUND_PRODUCT=weight.dtype == x3.dtype and x3.dtype != torch.float32, HAS_RESIDUAL=res2 is not None,
    )  # fmt: skip
