"""The MoE block's elementwise steps in one Triton launch each, the CUDA path of `RoutedExperts` where its
Triton bookkeeping runs (`SGLANG_GPU_MOE_BACKEND`):

- `silu_mul(gate, up)`: `silu(gate) * up`, the gated experts' and the shared expert's activation (torch:
  a silu and a mul, after a split for the experts);
- `add_sigmoid_mul(out, shared, gate)`: `out + sigmoid(gate) * shared`, the shared expert's gated
  contribution (torch: a sigmoid, a mul and an add).

The arithmetic is torch's, rounding where torch rounds each op's result to the activation dtype (a
no-op in float32); a GPU's exp and divide may differ from torch's by an ulp, which can move a bfloat16
rounding by one step. Rows may be strided (`gate` and `up` are halves of one projection). On CPU tensors
the kernels run only under `TRITON_INTERPRET=1`, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.triton_jit import jit_for_env

BLOCK = 1024  # columns per program


def _silu_mul_kernel(gate_ptr, up_ptr, out_ptr, gate_stride, up_stride, N: tl.constexpr, BN: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = cols < N
    act = out_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * gate_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_stride + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(act).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (s * u).to(act), mask=mask)


def _add_sigmoid_mul_kernel(
    out_ptr,
    shared_ptr,
    gate_ptr,
    res_ptr,
    out_stride,
    shared_stride,
    gate_stride,
    N: tl.constexpr,
    BN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = cols < N
    act = res_ptr.dtype.element_ty
    g = tl.load(gate_ptr + row * gate_stride).to(tl.float32)
    w = (1.0 / (1.0 + tl.exp(-g))).to(act).to(tl.float32)
    shared = tl.load(shared_ptr + row * shared_stride + cols, mask=mask, other=0.0).to(tl.float32)
    product = (w * shared).to(act).to(tl.float32)
    o = tl.load(out_ptr + row * out_stride + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(res_ptr + row * N + cols, (o + product).to(act), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [T, N] of one dtype -> silu(gate) * up [T, N] (rows contiguous)."""
    assert gate.shape == up.shape and gate.dim() == 2 and gate.dtype == up.dtype
    gate, up = _rows(gate), _rows(up)
    return _launch(_silu_mul_kernel, gate, (gate, up), (gate.stride(0), up.stride(0)))


def add_sigmoid_mul(out: torch.Tensor, shared: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out, shared [T, N], gate [T, 1] of one dtype -> out + sigmoid(gate) * shared [T, N]."""
    assert out.shape == shared.shape and out.dim() == 2 and gate.shape == (out.shape[0], 1)
    assert out.dtype == shared.dtype == gate.dtype
    out, shared = _rows(out), _rows(shared)
    strides = (out.stride(0), shared.stride(0), gate.stride(0))
    return _launch(_add_sigmoid_mul_kernel, out, (out, shared, gate), strides)


def _launch(kernel, like: torch.Tensor, inputs: tuple, strides: tuple) -> torch.Tensor:
    """A [T, N] result like `like`, from `kernel` over rows and blocks of BLOCK columns (nothing for T 0)."""
    t, n = like.shape
    result = torch.empty(t, n, dtype=like.dtype, device=like.device)
    if t:
        bn = min(BLOCK, triton.next_power_of_2(n))
        jit_for_env(kernel)[(t, triton.cdiv(n, bn))](*inputs, result, *strides, N=n, BN=bn)
    return result
