"""Qwen3-Next's attention output gate, `out * sigmoid(gate)`, in one Triton launch: the CUDA path of
`Qwen3NextAttention` (SGLANG_GPU_ELEMENTWISE_BACKEND). The gate is each head's second half of q_proj's
rows ([T, H, D] cut out of the projection, so its rows are strided); the torch form copies it to
[T, H D] first (`reshape`), then takes a sigmoid and a product: three launches per attention layer.
The arithmetic is the torch form's: the sigmoid in float32 rounded to the activation dtype, the product
rounded again (a GPU's exp may differ from torch's by an ulp, which can move a rounding by one step).
On CPU tensors the kernel runs only under `TRITON_INTERPRET=1`, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.triton_jit import jit_for_env


def _sigmoid_gate_mul_kernel(
    out_ptr, gate_ptr, res_ptr, out_stride, gate_tstride, gate_hstride, HEADS: tl.constexpr, D: tl.constexpr,
    BH: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """One token: res[t, h D + j] = out[t, h D + j] * sigmoid(gate[t, h, j]) over every head h."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BH)[:, None]
    j = tl.arange(0, BD)[None, :]
    m = (h < HEADS) & (j < D)
    act = res_ptr.dtype.element_ty
    g = tl.load(gate_ptr + t * gate_tstride + h * gate_hstride + j, mask=m, other=0.0).to(tl.float32)
    s = (1.0 / (1.0 + tl.exp(-g))).to(act).to(tl.float32)
    o = tl.load(out_ptr + t * out_stride + h * D + j, mask=m, other=0.0).to(tl.float32)
    tl.store(res_ptr + t * (HEADS * D) + h * D + j, (o * s).to(act), mask=m)


def sigmoid_gate_mul(out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """out [T, H D] (rows may be strided), gate [T, H, D] (any token and head strides, unit last stride)
    of one dtype -> out * sigmoid(gate) as [T, H D], contiguous."""
    t, heads, d = gate.shape
    assert out.shape == (t, heads * d) and out.dtype == gate.dtype and out.stride(-1) == gate.stride(-1) == 1
    res = torch.empty(t, heads * d, dtype=out.dtype, device=out.device)
    if t:
        jit_for_env(_sigmoid_gate_mul_kernel)[(t,)](
            out, gate, res, out.stride(0), gate.stride(0), gate.stride(1), HEADS=heads, D=d,
            BH=triton.next_power_of_2(heads), BD=triton.next_power_of_2(d),
        )  # fmt: skip
    return res
