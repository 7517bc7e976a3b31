"""Single-token decode kernels of the linear-attention layers in Triton, in place on the pool (the CUDA
path; on CPU tensors they run only under `TRITON_INTERPRET=1`, for tests on tiny shapes):

- `causal_conv1d_update_inplace`: the depthwise conv over each request's conv state, read from its
  running slot and shifted there in place (the new input enters the window); returns silu(conv). Twin:
  `causal_conv1d.causal_conv1d_update` with a gather and a scatter around it.
- `mamba2_decode_inplace`: the Mamba2 selective state update of each (request, head), reading x, B and
  C straight from the conv output (B and C of a group shared by its heads, no repeat copies), updating
  the state in the running slot and returning y = S C + D x. Twin: `ssd.selective_state_update`.

No gather or scatter copies of whole states and no host reads: the slots are a device tensor, so the
launches are CUDA-graph safe; padded rows point at the dummy slot 0, which absorbs their writes. The
Gated DeltaNet step is `linear/gdn_decode_triton.py`, built the same way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang.srt.utils.triton_jit import add, jit_for_env


def _conv_update_kernel(
    x_ptr,
    state_ptr,
    slot_ptr,
    src_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    slot_stride,
    x_stride,
    CHANNELS: tl.constexpr,
    KEEP: tl.constexpr,
    BKEEP: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    b = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    offs_j = tl.arange(0, BKEEP)
    mc = offs_c < CHANNELS
    mj = offs_j < KEEP
    slot = tl.load(slot_ptr + b).to(tl.int64)
    base = state_ptr + slot * slot_stride
    src = state_ptr + tl.load(src_ptr + b).to(tl.int64) * slot_stride  # `base` itself, but in a verify
    tile = offs_c[:, None] * KEEP + offs_j[None, :]
    m2 = mc[:, None] & mj[None, :]
    state = tl.load(src + tile, mask=m2, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs_c[:, None] * (KEEP + 1) + offs_j[None, :], mask=m2, other=0.0).to(tl.float32)
    w_last = tl.load(w_ptr + offs_c * (KEEP + 1) + KEEP, mask=mc, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + b.to(tl.int64) * x_stride + offs_c, mask=mc, other=0.0).to(tl.float32)
    acc = tl.reduce(state * w, 1, add) + x * w_last
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)
    tl.store(out_ptr + b * CHANNELS + offs_c, acc / (1.0 + tl.exp(-acc)), mask=mc)
    # The window moves one input on: column j takes column j + 1, the last one the new input.
    shifted = tl.load(src + tile + 1, mask=mc[:, None] & (offs_j[None, :] < KEEP - 1), other=0.0)
    new = tl.where(offs_j[None, :] == KEEP - 1, x[:, None].to(shifted.dtype), shifted)
    tl.store(base + tile, new.to(state_ptr.dtype.element_ty), mask=m2)


def _mamba2_decode_kernel(
    xbc_ptr,
    dt_ptr,
    a_ptr,
    d_ptr,
    state_ptr,
    slot_ptr,
    src_ptr,
    y_ptr,
    slot_stride,
    dt_stride,
    dt_bias_ptr,
    dt_min,
    HEADS: tl.constexpr,
    P: tl.constexpr,
    N: tl.constexpr,
    GROUPS: tl.constexpr,
    BP: tl.constexpr,
    BN: tl.constexpr,
    GATED: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BP + tl.arange(0, BP)
    offs_n = tl.arange(0, BN)
    mp = offs_p < P
    mn = offs_n < N
    grp = h // (HEADS // GROUPS)
    row = xbc_ptr + b * (HEADS * P + 2 * GROUPS * N)
    x = tl.load(row + h * P + offs_p, mask=mp, other=0.0).to(tl.float32)
    B = tl.load(row + HEADS * P + grp * N + offs_n, mask=mn, other=0.0).to(tl.float32)
    C = tl.load(row + HEADS * P + GROUPS * N + grp * N + offs_n, mask=mn, other=0.0).to(tl.float32)
    bh = b * HEADS + h
    dt = tl.load(dt_ptr + b.to(tl.int64) * dt_stride + h).to(tl.float32)
    a = tl.load(a_ptr + h).to(tl.float32)
    if GATED:  # dt and A from the raw projection and the layer's parameters, as the torch form makes them:
        # softplus (threshold 20; exp(x) where log(1 + exp(x)) loses it) of dt + dt_bias, clamped below
        # at dt_min; A = -exp(A_log) (a_ptr: A_log)
        x_dt = dt + tl.load(dt_bias_ptr + h).to(tl.float32)
        e = tl.exp(tl.minimum(x_dt, 20.0, propagate_nan=tl.PropagateNan.ALL))
        # log1p(e) to float32 precision (Kahan's form: log(u) scaled by e / (u - 1), u = 1 + e rounded)
        u = 1.0 + e
        log1p = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
        dt = tl.where(x_dt > 20.0, x_dt, log1p)
        dt = tl.maximum(dt, dt_min, propagate_nan=tl.PropagateNan.ALL)  # (torch's clamp keeps a NaN)
        a = -tl.exp(a)
    decay = tl.exp(dt * a)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    base = state_ptr + slot * slot_stride + h * (P * N)
    src = state_ptr + tl.load(src_ptr + b).to(tl.int64) * slot_stride + h * (P * N)
    tile = offs_p[:, None] * N + offs_n[None, :]
    m2 = mp[:, None] & mn[None, :]
    s = tl.load(src + tile, mask=m2, other=0.0).to(tl.float32)
    s = s * decay + (dt * x)[:, None] * B[None, :]
    y = tl.reduce(s * C[None, :], 1, add) + tl.load(d_ptr + h).to(tl.float32) * x
    tl.store(y_ptr + bh * P + offs_p, y.to(y_ptr.dtype.element_ty), mask=mp)
    tl.store(base + tile, s.to(state_ptr.dtype.element_ty), mask=m2)


def conv_block(channels: int, keep: int) -> int:
    """Channels per program: a [BC, keep] float32 tile of at most 8 KB."""
    return max(16, min(triton.next_power_of_2(channels), 2048 // triton.next_power_of_2(keep)))


def causal_conv1d_update_inplace(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    slots: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    src_slots: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [bs, C] (rows may be strided: a column slice of the projection's product is read in place);
    `conv_state` is one layer of the pool, [slots, C, K-1] (any float dtype, rows contiguous); weight
    [C, K]; `slots` [bs] int64 on the same device. Shifts the states of `slots` in place and returns
    silu(conv) [bs, C] float32; with `src_slots` (rows distinct from every slot written) the windows are
    read there and left as they are (a speculative verify)."""
    bs, channels = x.shape
    keep = weight.shape[1] - 1
    assert conv_state.shape[1:] == (channels, keep) and conv_state[0].is_contiguous(), "layout [C, K-1]"
    out = torch.empty(bs, channels, dtype=torch.float32, device=x.device)
    if bs == 0:
        return out
    bc = conv_block(channels, keep)
    if x.stride(-1) != 1:
        x = x.contiguous()
    jit_for_env(_conv_update_kernel)[(bs, triton.cdiv(channels, bc))](
        x,
        conv_state,
        slots.contiguous(),
        (slots if src_slots is None else src_slots).contiguous(),
        weight.contiguous(),
        bias if bias is not None else weight,  # unread without a bias
        out,
        conv_state.stride(0),
        x.stride(0),
        CHANNELS=channels,
        KEEP=keep,
        BKEEP=triton.next_power_of_2(keep),
        BC=bc,
        HAS_BIAS=bias is not None,
    )
    return out


# The Mamba2 step's [BP, N] float32 tile of the state holds at most TILE_FLOATS values (16 KB), on
# NUM_WARPS warps: 128 registers, no spill on sm_90. `bench_kernels.py --sweep` times other pairs.
TILE_FLOATS = 4096
NUM_WARPS = 4


def head_block(head_dim: int, state_size: int) -> int:
    """Head rows per program: a [BP, N] float32 tile of at most TILE_FLOATS values in registers."""
    return max(1, min(triton.next_power_of_2(head_dim), TILE_FLOATS // triton.next_power_of_2(state_size)))


def mamba2_decode_inplace(
    xbc: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    D: torch.Tensor,
    ssm: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
    head_dim: int,
    groups: int,
    state_size: int,
    src_slots: torch.Tensor | None = None,
    gates: tuple[torch.Tensor, torch.Tensor, float] | None = None,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """xbc [bs, H*P + 2*G*N] (the conv output: x | B | C), dt [bs, H] (softplus'd and clamped; rows may
    be strided), A, D [H] (any float dtype); `ssm` is one layer of the pool, [slots, H, P, N]. Updates the
    states of `slots` in place and returns y [bs, H, P] in `out_dtype` (D skip included; rounded from
    float32 as torch's cast rounds); with `src_slots` (rows distinct from every slot written) the states
    are read there and left as they are (a speculative verify). `gates` = (dt_bias, A_log, dt_min): dt is
    the projection's raw slice and A None, the gating done in the kernel (the torch form's ~6 launches
    per layer)."""
    bs = xbc.shape[0]
    assert xbc.shape[1] == heads * head_dim + 2 * groups * state_size and heads % groups == 0
    assert ssm.shape[1:] == (heads, head_dim, state_size) and ssm[0].is_contiguous(), "layout [H, P, N]"
    y = torch.empty(bs, heads, head_dim, dtype=out_dtype, device=xbc.device)
    if bs == 0:
        return y
    if dt.stride(-1) != 1:
        dt = dt.contiguous()
    dt_bias, a, dt_min = (gates[0].contiguous(), gates[1].contiguous(), float(gates[2])) if gates else (dt, A, 0.0)
    bp = head_block(head_dim, state_size)
    jit_for_env(_mamba2_decode_kernel)[(bs, heads, triton.cdiv(head_dim, bp))](
        xbc.contiguous(),
        dt,
        a.contiguous(),
        D.contiguous(),
        ssm,
        slots.contiguous(),
        (slots if src_slots is None else src_slots).contiguous(),
        y,
        ssm.stride(0),
        dt.stride(0),
        dt_bias,
        dt_min,
        HEADS=heads,
        P=head_dim,
        N=state_size,
        GROUPS=groups,
        BP=bp,
        BN=triton.next_power_of_2(state_size),
        GATED=gates is not None,
        num_warps=NUM_WARPS,
    )
    return y


# ---- extend: the conv over a whole variable-length batch ---------------------------------------------


def _conv_extend_kernel(
    x_ptr,
    state_ptr,
    cu_ptr,
    slot_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    slot_stride,
    CHANNELS: tl.constexpr,
    KEEP: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """out[t] = silu(sum_j w[:, j] * in(t + j - KEEP) + bias) for a [BT, BC] tile of one sequence, where
    in(i) is the sequence's input i, or for i < 0 column KEEP + i of its initial conv state."""
    # Token tiles on grid axis 0 (up to 2^31 - 1 programs; axes 1 and 2 stop at 65,535).
    b = tl.program_id(1)
    start = tl.load(cu_ptr + b)
    length = tl.load(cu_ptr + b + 1) - start
    offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
    offs_c = tl.program_id(2) * BC + tl.arange(0, BC)
    mt = offs_t < length
    mc = offs_c < CHANNELS
    state = state_ptr + tl.load(slot_ptr + b).to(tl.int64) * slot_stride
    # tl.full, not tl.zeros: a jitted helper (sglang.srt.utils.triton_jit says why).
    acc = tl.full((BT, BC), 0.0, tl.float32)
    for j in tl.static_range(KEEP + 1):
        i = offs_t + j - KEEP  # the input position this tap reads
        from_x = mt[:, None] & mc[None, :] & (i[:, None] >= 0)
        xv = tl.load(x_ptr + (start + i[:, None]) * CHANNELS + offs_c[None, :], mask=from_x, other=0.0)
        from_state = mt[:, None] & mc[None, :] & (i[:, None] < 0)
        sv = tl.load(state + offs_c[None, :] * KEEP + (KEEP + i[:, None]), mask=from_state, other=0.0)
        w = tl.load(w_ptr + offs_c * (KEEP + 1) + j, mask=mc, other=0.0).to(tl.float32)
        acc += (xv.to(tl.float32) + sv.to(tl.float32)) * w[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_c, mask=mc, other=0.0).to(tl.float32)[None, :]
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(
        out_ptr + (start + offs_t[:, None]) * CHANNELS + offs_c[None, :], out, mask=mt[:, None] & mc[None, :]
    )


def _conv_window_kernel(
    x_ptr,
    state_ptr,
    cu_ptr,
    slot_ptr,
    seq_ptr,
    off_ptr,
    dst_ptr,
    slot_stride,
    CHANNELS: tl.constexpr,
    KEEP: tl.constexpr,
    BKEEP: tl.constexpr,
    BC: tl.constexpr,
):
    """Entry e: the conv state after off[e] tokens of sequence seq[e] (inputs off - KEEP .. off - 1,
    from the extend or from its initial state) into slot dst[e]."""
    e = tl.program_id(0)
    offs_c = tl.program_id(1) * BC + tl.arange(0, BC)
    offs_j = tl.arange(0, BKEEP)
    mc = offs_c < CHANNELS
    b = tl.load(seq_ptr + e)
    start = tl.load(cu_ptr + b)
    i = tl.load(off_ptr + e) - KEEP + offs_j  # the input position of each state column
    m2 = mc[:, None] & (offs_j[None, :] < KEEP)
    src = state_ptr + tl.load(slot_ptr + b).to(tl.int64) * slot_stride
    xv = tl.load(
        x_ptr + (start + i[None, :]) * CHANNELS + offs_c[:, None], mask=m2 & (i[None, :] >= 0), other=0.0
    )
    sv = tl.load(src + offs_c[:, None] * KEEP + (KEEP + i[None, :]), mask=m2 & (i[None, :] < 0), other=0.0)
    window = xv.to(tl.float32) + sv.to(tl.float32)
    # The whole window is read before it is written: the final one goes to the running slot itself.
    dst = state_ptr + tl.load(dst_ptr + e).to(tl.int64) * slot_stride
    tl.store(dst + offs_c[:, None] * KEEP + offs_j[None, :], window.to(state_ptr.dtype.element_ty), mask=m2)


def causal_conv1d_extend_batch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    slots: torch.Tensor,
    max_len: int,
    snapshots: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """The conv of every sequence of an extend, x [T, C] (sequence b is tokens cu_seqlens[b] ..
    cu_seqlens[b+1], starting from the conv state in slots[b]), in three launches: the outputs
    (silu, [T, C] float32); the snapshots (`snapshots` = (sequence, offset, slot) tensors, slots other
    than the running ones); the final windows into the running slots. `max_len` (a host int) sizes the
    grid. Twin: `causal_conv1d.causal_conv1d_extend` per sequence."""
    total, channels = x.shape
    keep = weight.shape[1] - 1
    assert conv_state.shape[1:] == (channels, keep) and conv_state[0].is_contiguous(), "layout [C, K-1]"
    out = torch.empty(total, channels, dtype=torch.float32, device=x.device)
    batch = slots.numel()
    if batch == 0 or total == 0:
        return out
    x = x.contiguous()
    bc = conv_block(channels, keep)
    bt = max(1, min(triton.next_power_of_2(max_len), 2048 // bc))
    grid = (triton.cdiv(max_len, bt), batch, triton.cdiv(channels, bc))
    jit_for_env(_conv_extend_kernel)[grid](
        x, conv_state, cu_seqlens, slots, weight.contiguous(), bias if bias is not None else weight, out,
        conv_state.stride(0), CHANNELS=channels, KEEP=keep, BT=bt, BC=bc, HAS_BIAS=bias is not None,
    )  # fmt: skip
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    finals = (torch.arange(batch, device=x.device), lengths, slots)
    for seq, off, dst in [snapshots, finals] if snapshots is not None else [finals]:
        if seq.numel():
            jit_for_env(_conv_window_kernel)[(seq.numel(), triton.cdiv(channels, bc))](
                x, conv_state, cu_seqlens, slots, seq, off, dst, conv_state.stride(0),
                CHANNELS=channels, KEEP=keep, BKEEP=triton.next_power_of_2(keep), BC=bc,
            )  # fmt: skip
    return out
