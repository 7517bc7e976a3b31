"""A full-attention layer's new K and V rows written into the KV pool in one Triton launch: the CUDA path
of `MHATokenToKVPool.set_kv_buffer` for a 16-bit (or float32) pool storing the layer's own dtype unscaled
(SGLANG_GPU_ELEMENTWISE_BACKEND), where torch takes one `index_put_` for K and one for V. K and V may be
views with any token and head strides (column slices of a stacked projection's product). A float8 pool,
or scales other than 1, keep the torch form (its conversion and saturation). On CPU tensors the kernel
runs only under `TRITON_INTERPRET=1`, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.triton_jit import jit_for_env


def _store_kv_kernel(
    k_ptr, v_ptr, kbuf_ptr, vbuf_ptr, loc_ptr, k_tstride, k_hstride, v_tstride, v_hstride,
    HEADS: tl.constexpr, D: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """One token: its K and V rows (every head) copied to row loc[token] of the pool's [rows, HEADS, D]."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BH)[:, None]
    d = tl.arange(0, BD)[None, :]
    m = (h < HEADS) & (d < D)
    row = tl.load(loc_ptr + t).to(tl.int64)
    dst = (row * HEADS + h) * D + d
    tl.store(kbuf_ptr + dst, tl.load(k_ptr + t * k_tstride + h * k_hstride + d, mask=m), mask=m)
    tl.store(vbuf_ptr + dst, tl.load(v_ptr + t * v_tstride + h * v_hstride + d, mask=m), mask=m)


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k_buf, v_buf [rows, H, D] (contiguous, one dtype); k, v [T, H, D] of that dtype (unit last stride);
    loc [T] the rows to write (in range: the caller's allocator's rows, padding on the dummy row 0)."""
    t, heads, d = k.shape
    assert v.shape == k.shape and k_buf.shape[1:] == (heads, d) and k_buf.is_contiguous() and v_buf.is_contiguous()
    assert k.dtype == v.dtype == k_buf.dtype == v_buf.dtype and k.stride(-1) == v.stride(-1) == 1
    assert loc.dim() == 1 and loc.numel() == t, "one row per token"
    if t:
        jit_for_env(_store_kv_kernel)[(t,)](
            k, v, k_buf, v_buf, loc.contiguous(), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            HEADS=heads, D=d, BH=triton.next_power_of_2(heads), BD=triton.next_power_of_2(d),
        )  # fmt: skip
