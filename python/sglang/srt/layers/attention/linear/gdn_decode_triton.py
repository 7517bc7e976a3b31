"""Gated DeltaNet single-token decode in Triton, in place on the pool: each program reads one block of
value rows of one head's state straight from the request's running slot, applies the gated delta
update for the batch's token and writes the block back to the same slot. No gather or scatter copies
of whole states, no host reads: the slots are a device tensor, so the launch is CUDA-graph safe.

The math is `recurrent_gated_delta_rule_step` (the torch twin the tests compare against), per
(request b, value head h), with the pool's state layout `[V, K]` (value rows first):

    S = S * exp(g);  delta = (v - S k) * beta;  S = S + delta k^T;  out = S q

q and k arrive normalised, scaled and repeated to the value heads, as the torch path makes them.
Padded rows (CUDA graphs) point at the dummy slot 0, which absorbs their writes.

On CPU tensors the kernel runs only under `TRITON_INTERPRET=1` (tests on tiny shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.triton_jit import add, jit_for_env


def _gdn_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slot_ptr,
    out_ptr,
    slot_stride,
    NUM_HEADS: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    bh = b * NUM_HEADS + h
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    tile = offs_v[:, None] * K + offs_k[None, :]
    m2 = mv[:, None] & mk[None, :]
    base = state_ptr + slot * slot_stride + h * (V * K)
    s = tl.load(base + tile, mask=m2, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + bh * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    q = tl.load(q_ptr + bh * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(v_ptr + bh * V + offs_v, mask=mv, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + bh).to(tl.float32)
    beta = tl.load(beta_ptr + bh).to(tl.float32)
    s = s * tl.exp(g)
    # tl.reduce with our own combine, not tl.sum (sglang.srt.utils.triton_jit says why).
    predicted = tl.reduce(s * k[None, :], 1, add)
    delta = (v - predicted) * beta
    s = s + delta[:, None] * k[None, :]
    out = tl.reduce(s * q[None, :], 1, add)
    tl.store(out_ptr + bh * V + offs_v, out, mask=mv)
    tl.store(base + tile, s.to(state_ptr.dtype.element_ty), mask=m2)


def block_v(value_dim: int, key_dim: int) -> int:
    """Value rows per program: a [BV, K] float32 tile of at most 16 KB in registers."""
    bk = triton.next_power_of_2(key_dim)
    return max(1, min(triton.next_power_of_2(value_dim), 4096 // bk))


def gdn_decode_inplace(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    ssm: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """q, k [bs, H, K], v [bs, H, V], g, beta [bs, H]; `ssm` is one layer of the pool, [slots, H, V, K]
    (any float dtype, rows contiguous); `slots` [bs] int64 on the same device. Updates the states of
    `slots` in place and returns the output [bs, H, V] float32."""
    bs, heads, key_dim = k.shape
    value_dim = v.shape[-1]
    assert ssm.shape[1:] == (heads, value_dim, key_dim) and ssm[0].is_contiguous(), "pool layout [H, V, K]"
    out = torch.empty(bs, heads, value_dim, dtype=torch.float32, device=v.device)
    if bs == 0:
        return out
    bv = block_v(value_dim, key_dim)
    grid = (bs, heads, triton.cdiv(value_dim, bv))
    jit_for_env(_gdn_decode_kernel)[grid](
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        g.contiguous(),
        beta.contiguous(),
        ssm,
        slots.contiguous(),
        out,
        ssm.stride(0),
        NUM_HEADS=heads,
        K=key_dim,
        V=value_dim,
        BK=triton.next_power_of_2(key_dim),
        BV=bv,
    )
    return out
