"""Paged extend (prefill) attention in Triton, with a cached prefix: the new tokens of each request
attend causally to the keys of its `req_to_token` row, the prefix's and their own (stored in the KV
pool before the kernel runs).

One program per (request, query head, block of BLOCK_M new tokens) reads the slot ids of the keys
straight from `req_to_token` (any page size) and runs an online softmax over blocks of BLOCK_N keys, up
to the last key its block may see: query j of a request with prefix p sits at position p + j and sees
keys 0..p + j. GQA: query head h reads KV head h // group. Programs past a request's new tokens do
nothing (the grid is sized for the longest).
Block sizes: `block_sizes`.

On CPU tensors the kernel runs only under `TRITON_INTERPRET=1` (tests on tiny shapes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.layers.attention.triton_ops.decode_attention import MIN_DOT_DIM, f32_dot
from sglang.srt.utils.triton_jit import add, jit_for_env, maximum

NUM_WARPS = 8


def block_sizes(head_dim: int, f32: bool) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) for 8 warps: 64 queries x 32 keys with 16-bit dots up to 128 dims, 32 x 16
    with float32 dots or heads over 128 dims (Qwen3-Next's 256), so that the float32 accumulator
    [BLOCK_M, D] and the tiles stay in registers. The tiles before (64 x 64 and 32 x 32 on 4 warps)
    spilled 32-24,000 bytes per thread to local memory on sm_90 (`sglang.test.sm90` checks each
    variant); these keep 140-215 registers and none."""
    return (64, 32) if head_dim <= 128 and not f32 else (32, 16)


def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    o_ptr,
    req_to_token_ptr,
    rows_ptr,
    seq_lens_ptr,
    extend_lens_ptr,
    extend_starts_ptr,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_r2t,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    kvh = h // GROUP
    row = tl.load(rows_ptr + b).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    ext_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    q_start = tl.load(extend_starts_ptr + b).to(tl.int64)
    prefix = seq_len - ext_len

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = offs_m < ext_len
    offs_d = tl.arange(0, BLOCK_D)
    md = offs_d < D
    tokens = q_start + offs_m
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mm[:, None] & md[None, :],
        other=0.0,
    )
    if F32_DOT:
        q = q.to(tl.float32)
    q_pos = prefix + offs_m
    # Keys this block may see: up to its last new token; none for a block past the new tokens.
    end = tl.where(mb * BLOCK_M < ext_len, tl.minimum(prefix + (mb + 1) * BLOCK_M, seq_len), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for n0 in range(0, end, BLOCK_N):
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
        visible = mn[None, :] & (offs_n[None, :] <= q_pos[:, None])
        s = tl.where(visible, s * sm_scale, float("-inf"))
        # Key 0 is in the first block and every query sees it, so m_new stays finite from there on.
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

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        o_ptr + tokens[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(o_ptr.dtype.element_ty),
        mask=mm[:, None] & md[None, :],
    )


def extend_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
) -> None:
    """q [T, Hq, D] of the batch's new tokens (request i's at `extend_start_loc[i]`, `extend_seq_lens[i]`
    of them); k_buffer, v_buffer [slots, Hk, D] (one layer of the KV pool, the new tokens' K/V already
    stored); writes o [T, Hq, D]. `max_extend_len` (a host int) sizes the grid."""
    num_tokens, num_q_heads, head_dim = q.shape
    bs = req_pool_indices.shape[0]
    num_kv_heads = k_buffer.shape[1]
    if bs == 0 or num_tokens == 0:
        return
    assert num_q_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert q.stride(-1) == k_buffer.stride(-1) == v_buffer.stride(-1) == o.stride(-1) == 1
    f32 = f32_dot(q.dtype, k_buffer.dtype)
    block_m, block_n = block_sizes(head_dim, f32)
    grid = (bs, num_q_heads, triton.cdiv(max_extend_len, block_m))
    jit_for_env(_extend_kernel)[grid](
        q,
        k_buffer,
        v_buffer,
        o,
        req_to_token,
        req_pool_indices,
        seq_lens,
        extend_seq_lens,
        extend_start_loc,
        sm_scale,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        o.stride(0),
        o.stride(1),
        req_to_token.stride(0),
        GROUP=num_q_heads // num_kv_heads,
        D=head_dim,
        BLOCK_D=max(MIN_DOT_DIM, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        F32_DOT=f32,
        num_warps=NUM_WARPS,
    )
