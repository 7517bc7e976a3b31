"""Paged decode attention in Triton (flash decoding): one query token per request against the keys of
its `req_to_token` row, split over the key range in two stages.

Stage 1: one program per (request, KV head, split) reads the slot ids of its part of the request's keys
straight from `req_to_token` (any page size: only slot ids are read), runs an online softmax over blocks
of keys for all the query heads of the KV head's group at once (GQA: `tl.dot` of a [group, D] query tile
with the [D, block] keys) and writes its partial output and log-sum-exp. Stage 2: one program per
(request, query head) combines the splits. Every length is read on the device, and the number of
splits is fixed per launch, so the launch is CUDA-graph safe; a padded row may point at the dummy
request row 0 with length 1.

On CPU tensors the kernels run only under `TRITON_INTERPRET=1` (tests on tiny shapes).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from sglang.srt.utils.triton_jit import add, jit_for_env, maximum

# Stage 1 runs on 8 warps over tiles of 32 keys (16 for float32 dots over heads of more than 128 dims):
# at 64 keys on 4 warps it spilled 32-1,360 bytes per thread to local memory on sm_90 (by dtype and head
# size; `sglang.test.sm90` checks every variant), these keep 90-210 registers and none.
STAGE1_WARPS = 8


def stage1_block_n(head_dim: int, f32: bool) -> int:
    """Keys per block of stage 1: a [BLOCK_N, D] tile of keys and one of values per iteration."""
    return 16 if f32 and head_dim > 128 else 32

# tl.dot needs every dimension to be at least 16.
MIN_DOT_DIM = 16


def f32_dot(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
    """Whether the kernels' dot products run in float32 (IEEE, not TF32): for float32 queries (outputs
    as exact as torch's), for a 16-bit KV pool of the other 16-bit dtype (`--kv-cache-dtype bf16` under
    a float16 model: neither converts exactly to the other), and under the interpreter, whose bfloat16
    `tl.dot` is wrong (Triton 3.x: errors of 1e10 on a 16 x 16 product). Otherwise the dots take the
    query's dtype (a float8 pool's values convert to it exactly), float32 accumulate."""
    mixed_16bit = kv_dtype is not None and kv_dtype.itemsize == 2 and kv_dtype != dtype
    return dtype == torch.float32 or mixed_16bit or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _decode_stage1_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    req_to_token_ptr,
    rows_ptr,
    seq_lens_ptr,
    mid_o_ptr,
    mid_lse_ptr,
    sm_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_r2t,
    NUM_Q_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    per_split = (seq_len + NUM_SPLITS - 1) // NUM_SPLITS
    start = split * per_split
    end = tl.minimum(start + per_split, seq_len)

    offs_g = tl.arange(0, BLOCK_H)
    heads = kvh * GROUP + offs_g
    mh = offs_g < GROUP
    offs_d = tl.arange(0, BLOCK_D)
    md = offs_d < D
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mh[:, None] & md[None, :],
        other=0.0,
    )
    if F32_DOT:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_H], 0.0, tl.float32)
    acc = tl.full([BLOCK_H, BLOCK_D], 0.0, tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mn = offs_n < end
        slots = tl.load(req_to_token_ptr + row * stride_r2t + offs_n, mask=mn, other=0).to(tl.int64)
        k = tl.load(
            k_ptr + slots[None, :] * stride_kt + kvh * stride_kh + offs_d[:, None],
            mask=md[:, None] & mn[None, :],
            other=0.0,
        )
        if F32_DOT:
            s = tl.dot(q, k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k.to(q.dtype))  # a float8 pool's keys in the query's dtype (exact)
        s = tl.where(mn[None, :], s * sm_scale, float("-inf"))
        # Every block holds at least one key of the range, so m_new is finite.
        m_new = tl.maximum(m_i, tl.reduce(s, 1, maximum))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.reduce(p, 1, add)
        v = tl.load(
            v_ptr + slots[:, None] * stride_vt + kvh * stride_vh + offs_d[None, :],
            mask=mn[:, None] & md[None, :],
            other=0.0,
        )
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    # An empty split (fewer keys than splits) leaves l_i 0: weight 0 in stage 2 through lse = -inf.
    has = l_i > 0
    out = acc / tl.where(has, l_i, 1.0)[:, None]
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    base = (b * NUM_Q_HEADS + heads) * NUM_SPLITS + split
    tl.store(mid_o_ptr + base[:, None] * D + offs_d[None, :], out, mask=mh[:, None] & md[None, :])
    tl.store(mid_lse_ptr + base, lse, mask=mh)


def _decode_stage2_kernel(
    mid_o_ptr,
    mid_lse_ptr,
    o_ptr,
    stride_ob,
    stride_oh,
    NUM_Q_HEADS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    ms = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, BLOCK_D)
    md = offs_d < D
    base = (b * NUM_Q_HEADS + h) * NUM_SPLITS + offs_s
    lse = tl.load(mid_lse_ptr + base, mask=ms, other=float("-inf"))
    # The first split always holds key 0, so the maximum is finite.
    weight = tl.exp(lse - tl.reduce(lse, 0, maximum))
    parts = tl.load(
        mid_o_ptr + base[:, None] * D + offs_d[None, :], mask=ms[:, None] & md[None, :], other=0.0
    )
    out = tl.reduce(parts * weight[:, None], 0, add) / tl.reduce(weight, 0, add)
    tl.store(o_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(o_ptr.dtype.element_ty), mask=md)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int = 8,
) -> None:
    """q [bs, Hq, D] (last dim contiguous); k_buffer, v_buffer [slots, Hk, D] (one layer of the KV
    pool); writes o [bs, Hq, D]. Request i attends to slots `req_to_token[req_pool_indices[i],
    :seq_lens[i]]` (its new token's K/V already stored there). `num_kv_splits` splits of the key range
    per request run in parallel, then are combined."""
    bs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    if bs == 0:
        return
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == k_buffer.stride(-1) == v_buffer.stride(-1) == o.stride(-1) == 1
    group = num_q_heads // num_kv_heads
    block_d = max(MIN_DOT_DIM, triton.next_power_of_2(head_dim))
    f32 = f32_dot(q.dtype, k_buffer.dtype)
    mid_o = torch.empty(bs, num_q_heads, num_kv_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(bs, num_q_heads, num_kv_splits, dtype=torch.float32, device=q.device)
    jit_for_env(_decode_stage1_kernel)[(bs, num_kv_heads, num_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_pool_indices,
        seq_lens,
        mid_o,
        mid_lse,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        NUM_Q_HEADS=num_q_heads,
        GROUP=group,
        D=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=max(MIN_DOT_DIM, triton.next_power_of_2(group)),
        BLOCK_N=stage1_block_n(head_dim, f32),
        NUM_SPLITS=num_kv_splits,
        F32_DOT=f32,
        num_warps=STAGE1_WARPS,
    )
    jit_for_env(_decode_stage2_kernel)[(bs, num_q_heads)](
        mid_o,
        mid_lse,
        o,
        o.stride(0),
        o.stride(1),
        NUM_Q_HEADS=num_q_heads,
        D=head_dim,
        BLOCK_D=block_d,
        NUM_SPLITS=num_kv_splits,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
    )
