"""Gated DeltaNet single-token decode in Triton, in place on the pool: each program reads one block of
value rows of one head's state straight from the request's running slot, applies the gated delta
update for the batch's token and writes the block back to the same slot. No gather or scatter copies
of whole states, no host reads: the slots are a device tensor, so the launch is CUDA-graph safe.

One launch per layer does everything between the conv and the output norm: it reads q, k and v out of
the conv output where they sit, normalises q and k (l2, q scaled by K^-1/2), shares each key head with
its value heads, and computes the gates from the projections' raw a and b (g = -exp(A_log) *
softplus(a + dt_bias), beta = sigmoid(b)); the torch form of that prep is ~20 small kernels per layer.
The math is then `recurrent_gated_delta_rule_step` (the torch twin the tests compare against), per
(request b, value head h), with the pool's state layout `[V, K]` (value rows first):

    S = S * exp(g);  delta = (v - S k) * beta;  S = S + delta k^T;  out = S q

Padded rows (CUDA graphs) point at the dummy slot 0, which absorbs their writes.

On CPU tensors the kernel runs only under `TRITON_INTERPRET=1` (tests on tiny shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.triton_jit import add, jit_for_env


def _gdn_decode_kernel(
    x_ptr,
    a_ptr,
    b_ptr,
    a_log_ptr,
    dt_bias_ptr,
    state_ptr,
    slot_ptr,
    src_ptr,
    out_ptr,
    x_stride,
    ab_stride,
    slot_stride,
    NUM_HEADS: tl.constexpr,
    KEY_HEADS: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    FUSED_OUT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    vb = tl.program_id(2)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    src = tl.load(src_ptr + b).to(tl.int64)
    row = b.to(tl.int64) * x_stride
    kh = h // (NUM_HEADS // KEY_HEADS)  # consecutive value heads share a key head
    offs_k = tl.arange(0, BK)
    offs_v = vb * BV + tl.arange(0, BV)
    mk = offs_k < K
    mv = offs_v < V
    tile = offs_v[:, None] * K + offs_k[None, :]
    m2 = mv[:, None] & mk[None, :]
    base = state_ptr + slot * slot_stride + h * (V * K)
    s = tl.load(state_ptr + src * slot_stride + h * (V * K) + tile, mask=m2, other=0.0).to(tl.float32)
    # x = [q (KEY_HEADS x K) | k (KEY_HEADS x K) | v (NUM_HEADS x V)]; l2norm as the torch form's, eps 1e-6.
    q = tl.load(x_ptr + row + kh * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    k = tl.load(x_ptr + row + (KEY_HEADS + kh) * K + offs_k, mask=mk, other=0.0).to(tl.float32)
    v = tl.load(x_ptr + row + 2 * KEY_HEADS * K + h * V + offs_v, mask=mv, other=0.0).to(tl.float32)
    q = q * (1.0 / tl.sqrt(tl.reduce(q * q, 0, add) + 1e-6)) * (1.0 / tl.sqrt(K * 1.0))
    k = k * (1.0 / tl.sqrt(tl.reduce(k * k, 0, add) + 1e-6))
    # The gates, as the torch form: softplus with its threshold 20, log1p(exp(x)) below it to float32
    # precision (Kahan's form: log(u) scaled by e / (u - 1), u = 1 + e rounded; log(1 + e) alone erred by
    # up to ~17 % relative for x in (-15, -7)).
    ga = tl.load(a_ptr + b * ab_stride + h).to(tl.float32) + tl.load(dt_bias_ptr + h).to(tl.float32)
    e = tl.exp(tl.minimum(ga, 20.0, propagate_nan=tl.PropagateNan.ALL))
    u = 1.0 + e
    softplus = tl.where(ga > 20.0, ga, tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0))))
    g = -tl.exp(tl.load(a_log_ptr + h).to(tl.float32)) * softplus
    beta = 1.0 / (1.0 + tl.exp(-tl.load(b_ptr + b * ab_stride + h).to(tl.float32)))
    s = s * tl.exp(g)
    # tl.reduce with our own combine, not tl.sum (sglang.srt.utils.triton_jit says why).
    predicted = tl.reduce(s * k[None, :], 1, add)
    delta = (v - predicted) * beta
    if FUSED_OUT:
        # S' q = S q + delta (k . q): both reductions read the decayed tile, and the updated tile is
        # stored without a second pass over it (the same sums in another order).
        sq = tl.reduce(s * q[None, :], 1, add)
        s = s + delta[:, None] * k[None, :]
        tl.store(base + tile, s.to(state_ptr.dtype.element_ty), mask=m2)
        out = sq + delta * tl.reduce(k * q, 0, add)
        tl.store(out_ptr + (b * NUM_HEADS + h) * V + offs_v, out.to(out_ptr.dtype.element_ty), mask=mv)
    else:
        s = s + delta[:, None] * k[None, :]
        out = tl.reduce(s * q[None, :], 1, add)
        tl.store(out_ptr + (b * NUM_HEADS + h) * V + offs_v, out.to(out_ptr.dtype.element_ty), mask=mv)
        tl.store(base + tile, s.to(state_ptr.dtype.element_ty), mask=m2)


# A program's [BV, K] float32 tile of the state holds at most TILE_FLOATS values (16 KB), on NUM_WARPS
# warps: 128 registers, no spill on sm_90. `bench_kernels.py --sweep` times other pairs on a GPU.
TILE_FLOATS = 4096
NUM_WARPS = 4
# The output from the decayed tile (`FUSED_OUT` above), for `bench_kernels.py --sweep` to time against
# the output from the updated tile; on an H200 the kernel's share of the HBM peak at batch 256 was
# about the same either way of tiling (benchmark/gpu/README.md). Not yet timed on a GPU.
FUSED_OUT = False


def block_v(value_dim: int, key_dim: int) -> int:
    """Value rows per program: a [BV, K] float32 tile of at most TILE_FLOATS values in registers."""
    bk = triton.next_power_of_2(key_dim)
    return max(1, min(triton.next_power_of_2(value_dim), TILE_FLOATS // bk))


def gdn_decode_inplace(
    x: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    ssm: torch.Tensor,
    slots: torch.Tensor,
    key_heads: int,
    key_dim: int,
    src_slots: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x [bs, 2 * key_heads * key_dim + H * V], the conv output (rows contiguous); a, b [bs, H] the raw
    gate projections (rows may be strided, the same stride for both); a_log, dt_bias [H]; `ssm` is one
    layer of the pool, [slots, H, V, K] (any float dtype, rows contiguous); `slots` [bs] int64 on the
    same device. Updates the states of `slots` in place and returns the output [bs, H, V] in `out_dtype`
(rounded to it from float32 as torch's cast rounds: the layer's dtype saves the cast's launch); with
    `src_slots` ([bs], rows distinct from every slot written) it reads the states there instead, which
    stay as they are (a speculative verify's positions, each from the one before)."""
    bs = x.shape[0]
    heads, value_dim = ssm.shape[1], ssm.shape[2]
    assert ssm.shape[3] == key_dim and ssm[0].is_contiguous(), "pool layout [H, V, K]"
    assert x.shape[1] == 2 * key_heads * key_dim + heads * value_dim and heads % key_heads == 0
    out = torch.empty(bs, heads, value_dim, dtype=out_dtype, device=x.device)
    if bs == 0:
        return out
    if x.stride(1) != 1:
        x = x.contiguous()
    if a.stride(1) != 1 or b.stride(1) != 1 or a.stride(0) != b.stride(0):
        a, b = a.contiguous(), b.contiguous()
    bv = block_v(value_dim, key_dim)
    grid = (bs, heads, triton.cdiv(value_dim, bv))
    jit_for_env(_gdn_decode_kernel)[grid](
        x, a, b, a_log, dt_bias, ssm, slots.contiguous(), (slots if src_slots is None else src_slots).contiguous(),
        out, x.stride(0), a.stride(0), ssm.stride(0),
        NUM_HEADS=heads, KEY_HEADS=key_heads, K=key_dim, V=value_dim, BK=triton.next_power_of_2(key_dim), BV=bv,
        FUSED_OUT=FUSED_OUT, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out
