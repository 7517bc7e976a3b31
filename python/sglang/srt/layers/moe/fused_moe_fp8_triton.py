"""The routed experts in block-wise FP8 on CUDA: w13 [E, N13, H] and w2 [E, H, I] in float8_e4m3fn with
their block scales [E, ceil(N/128), ceil(K/128)] float32 (`w13_weight_scale_inv`, `w2_weight_scale_inv`
on `RoutedExperts`, upstream's names), activations quantized per token and per 128-column group as in
`layers/quantization/fp8_kernel.py`.

One layer's forward, a fixed number of launches and no host read (a CUDA graph can capture it):
1. the assignments sorted by expert (`dispatch_triton.moe_align` at decode sizes, torch's stable sort
   above them): the token of each sorted row and `offs`, the cumulative rows per expert (other EP
   ranks' assignments, id E, sort last, outside `offs`: no tile computes them);
2. x quantized once per token (not once per assignment: the w13 GEMM gathers its rows by token);
3. `moe_gemm_fp8` for w13, over tiles of BLOCK_M sorted rows of one expert each: the tile count is
   bounded without reading the counts (sum over experts of ceil(c_e / BLOCK_M) <= ceil(T k / BLOCK_M) +
   min(E, T k)), so the grid has that many and the surplus programs return at once; each program finds
   its expert among the cumulative tile counts (`tile_end`, one small launch: `tile_map`);
4. the activation, quantized again (gated silu: in the quantization's own launch);
5. `moe_gemm_fp8` for w2 over the same tiles, the rows in sorted order;
6. the top-k rows of each token combined in float32 with their routing weights.
Steps 1 and 6 are `sort_combine.py`'s, shared with the 16-bit paths. The grouped GEMM kernel serves the
16-bit experts too (`FP8=False`: no scales, the gated activation in the w13 GEMM's epilogue), launched
by `fused_moe_triton.py`.

`fused_experts_fp8_torch` is the twin: the same quantizations, each expert's weights dequantized and its
rows multiplied in float32, the intermediate rounded to the activation dtype where the kernels round it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from sglang.srt.layers.quantization.fp8_kernel import (
    BLOCK,
    FP8_DTYPE,
    check_block_operands,
    dequantize_block_fp8,
    per_token_group_quant_fp8,
    per_token_group_quant_fp8_torch,
)

try:  # the twin serves a CPU install without triton
    import triton
    import triton.language as tl

    from sglang.srt.layers.moe.dispatch_triton import tile_ends
    from sglang.srt.layers.quantization.fp8_kernel import block_scaled_dot
    from sglang.srt.utils.triton_jit import add, jit_for_env
except ImportError:  # pragma: no cover
    triton = None


class MoeGemmConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# Tiles by the mean rows per expert (T k / E), the first whose bound holds it; autotune-free. Decode at the
# 80B's shapes (512 experts, top 10) has 1.25 rows per expert at batch 64 and 5 at 256: a tile of 16 rows
# (mma's smallest useful M) wastes the least, and the work is reading each touched expert's weights once,
# so 64-column tiles give more programs to stream them. Prefill (8,192 tokens: 160 rows per expert) takes
# upstream's default for block FP8, 64 x 128 x 128 with 4 warps and 3 stages; between them 32-row tiles.
# BLOCK_K is the scale block. Measured on an H200 (2026-11-30, `bench_fp8_gemm.py --sweep`, the 80B's
# experts): 16 x 64 fastest at 1.25 and 5 rows (at 5: 0.51 ms against 32 x 128's 0.59, which the first
# bound of 4 gave), 64 x 128 at 160 (1.85 ms; 32 x 128 3.04). Each row compiles for sm_90 without
# spilling (test_fused_moe_fp8_triton.py).
MOE_GEMM_CONFIGS: tuple[tuple[float, MoeGemmConfig], ...] = (
    (8.0, MoeGemmConfig(16, 64, 128, 4, 4)),
    (32.0, MoeGemmConfig(32, 128, 128, 4, 4)),
    (float("inf"), MoeGemmConfig(64, 128, 128, 4, 3)),
)


def config_by_mean_rows(
    configs: tuple[tuple[float, MoeGemmConfig], ...], assignments: int, num_experts: int
) -> MoeGemmConfig:
    """The tile of `configs` ((bound, tile) pairs: this module's MOE_GEMM_CONFIGS or
    `moe_configs.FALLBACK_CONFIGS`) for `assignments` rows over `num_experts` experts: the first whose
    bound holds the mean rows per expert."""
    mean_rows = assignments / max(num_experts, 1)
    return next(cfg for bound, cfg in configs if mean_rows <= bound)


def _moe_gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, token_ptr, offs_ptr, tile_end_ptr,
    N, K, a_stride, AS_COLS, BS_COLS, b_expert_stride, bs_expert_stride,
    E: tl.constexpr, E_POW2: tl.constexpr, GATHER: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    SILU_MUL: tl.constexpr, RELU2: tl.constexpr,
):  # fmt: skip
    """c[r] = (a[row r] * as) @ (b[e] * bs[e])^T for the sorted rows r of expert e, one BLOCK_M tile of
    one expert per program along axis 0; a's row is token_ptr[r] where GATHER, else r. FP8: a and b in
    e4m3 with their block scales; else a and b in one 16-bit dtype, no scales (as_ptr, bs_ptr unused),
    and where SILU_MUL, b holds 2N rows (gate then up) and c[r] = silu(a b_gate^T) * (a b_up^T), the
    gated activation in the epilogue: w2's input straight from w13's GEMM, rounded once. RELU2 (plain
    experts, Nemotron-H's): c[r] = relu(a b^T)^2 in the epilogue, the product rounded to c's dtype first
    as torch's relu and square of the GEMM's output round it."""
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    ev = tl.arange(0, E_POW2)
    ends = tl.load(tile_end_ptr + ev, mask=ev < E, other=2147483647)
    e = tl.reduce((ends <= pid_t).to(tl.int32), 0, add)
    if e >= E:
        return
    tiles_before = tl.load(tile_end_ptr + e - 1, mask=e > 0, other=0)
    row_start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0)
    row_end = tl.load(offs_ptr + e)
    rows = row_start + (pid_t - tiles_before) * BLOCK_M + tl.arange(0, BLOCK_M)
    mm = rows < row_end
    rows64 = rows.to(tl.int64)
    if GATHER:
        src = tl.load(token_ptr + rows64, mask=mm, other=0).to(tl.int64)
    else:
        src = rows64
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mn = rn < N
    e64 = e.to(tl.int64)
    a_ptrs = a_ptr + src[:, None] * a_stride + rk[None, :]
    b_ptrs = b_ptr + e64 * b_expert_stride + rn.to(tl.int64)[None, :] * K + rk[:, None]
    acc = (rows[:, None] * 0 + rn[None, :] * 0).to(tl.float32)  # zeros (triton_jit says why not tl.zeros)
    if FP8:
        as_ptrs = as_ptr + src * AS_COLS
        bs_ptrs = bs_ptr + e64 * bs_expert_stride + (rn // SCALE_N) * BS_COLS
        acc = block_scaled_dot(acc, a_ptrs, b_ptrs, as_ptrs, bs_ptrs, mm, mn, K, SCALE_K, BLOCK_K)
    else:
        up = (rows[:, None] * 0 + rn[None, :] * 0).to(tl.float32)
        for k0 in range(0, K, BLOCK_K):
            mk = rk < K - k0
            a = tl.load(a_ptrs, mask=mm[:, None] & mk[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=mk[:, None] & mn[None, :], other=0.0)
            acc += tl.dot(a, b)
            if SILU_MUL:  # the up rows, N rows below the gate rows
                b_up = tl.load(b_ptrs + N * K, mask=mk[:, None] & mn[None, :], other=0.0)
                up += tl.dot(a, b_up)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if SILU_MUL:
            acc = acc / (1.0 + tl.exp(-acc)) * up
        if RELU2:
            h = tl.maximum(acc.to(c_ptr.dtype.element_ty).to(tl.float32), 0.0, propagate_nan=tl.PropagateNan.ALL)
            acc = h * h
    c_ptrs = c_ptr + rows64[:, None] * N + rn[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])


def _tile_map_kernel(offs_ptr, tile_end_ptr, E, BLOCK_M: tl.constexpr, BE: tl.constexpr):
    """One program: tile_end[e] = sum over experts j <= e of ceil(rows_j / BLOCK_M), BE experts at a time
    (each chunk's inclusive sums by a BE x BE triangle, a running total across chunks)."""
    i = tl.arange(0, BE)
    carry = tl.program_id(0) * 0
    for e0 in range(0, E, BE):
        ev = e0 + i
        m = ev < E
        end = tl.load(offs_ptr + ev, mask=m, other=0)
        start = tl.load(offs_ptr + ev - 1, mask=m & (ev > 0), other=0)
        carry = tile_ends(end - start, i, carry, tile_end_ptr, ev, m, BLOCK_M)


# Experts per chunk of `_tile_map_kernel`: a 64 x 64 int32 triangle per step, 8 steps at 512 experts.
_TILE_MAP_BE = 64


def tile_map(offs: torch.Tensor, block_m: int) -> torch.Tensor:
    """offs [E] int32 (cumulative rows per expert) -> the cumulative count of BLOCK_M tiles per expert
    [E] int32: one launch (torch takes five: a diff, an add, a division, a cumsum, a cast)."""
    tile_end = torch.empty_like(offs)
    be = min(_TILE_MAP_BE, triton.next_power_of_2(offs.numel()))
    jit_for_env(_tile_map_kernel)[(1,)](offs, tile_end, offs.numel(), BLOCK_M=block_m, BE=be)
    return tile_end


def tile_map_torch(offs: torch.Tensor, block_m: int) -> torch.Tensor:
    """The twin of `tile_map`."""
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.cumsum((counts + block_m - 1) // block_m, 0).to(torch.int32)


def launch_moe_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    offs: torch.Tensor,
    token_of: torch.Tensor | None,
    config: MoeGemmConfig,
    tile_end: torch.Tensor | None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    block_size=(BLOCK, BLOCK),
    silu_mul: bool = False,
    relu2: bool = False,
) -> None:
    """Launch `_moe_gemm_kernel` writing out [rows, N]'s rows of experts (`moe_gemm_fp8`'s and
    `fused_moe_triton.moe_gemm`'s launch, operands checked by them): FP8 where `scales` (a's, weight's)
    are given, else 16-bit. The grid has the bound on the tile count (module docstring, step 3);
    `tile_end` is `tile_map`'s, computed here where None."""
    rows, n = out.shape
    num_experts, _, k = weight.shape
    if tile_end is None:
        tile_end = tile_map(offs, config.block_m)
    tiles = triton.cdiv(rows, config.block_m) + min(num_experts, rows)
    grid = (tiles, triton.cdiv(n, config.block_n))
    fp8 = scales is not None
    a_scale, w_scale = scales if fp8 else (a, weight)
    jit_for_env(_moe_gemm_kernel)[grid](
        a, a_scale, weight, w_scale, out, token_of if token_of is not None else offs, offs, tile_end,
        n, k, a.stride(0), a_scale.shape[1] if fp8 else 0, w_scale.shape[2] if fp8 else 0, weight.stride(0),
        w_scale.stride(0) if fp8 else 0, E=num_experts, E_POW2=triton.next_power_of_2(num_experts),
        GATHER=token_of is not None, SCALE_N=block_size[0] if fp8 else 1, SCALE_K=block_size[1] if fp8 else 1,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, FP8=fp8, SILU_MUL=silu_mul,
        RELU2=relu2,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def moe_gemm_fp8(
    a: torch.Tensor,
    a_scale: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    offs: torch.Tensor,
    rows: int,
    token_of: torch.Tensor | None,
    out_dtype: torch.dtype,
    config: MoeGemmConfig,
    tile_end: torch.Tensor | None = None,
    block_size=(BLOCK, BLOCK),
) -> torch.Tensor:
    """The grouped GEMM over `rows` sorted rows: row r of expert e (offs[e-1] <= r < offs[e]) is
    a[token_of[r]] (a [T, K] fp8, `a_scale` [T, ceil(K/bk)]) where `token_of` is given, else a[r];
    weight [E, N, K] fp8 with `weight_scale_inv` [E, ceil(N/bn), ceil(K/bk)]. Returns [rows, N]; rows
    past offs[-1] (other EP ranks' assignments) belong to no expert and are left unwritten."""
    check_block_operands(weight, weight_scale_inv, block_size)
    _, n, k = weight.shape
    assert a.dtype == FP8_DTYPE and a.shape[-1] == k and a.stride(-1) == 1
    a_scale = a_scale.contiguous()
    out = torch.empty(rows, n, dtype=out_dtype, device=a.device)
    if rows == 0:
        return out
    launch_moe_gemm(a, weight, out, offs, token_of, config, tile_end, (a_scale, weight_scale_inv), block_size)
    return out


def fused_experts_fp8(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activate: Callable[[torch.Tensor], torch.Tensor],
    block_size=(BLOCK, BLOCK),
    config: MoeGemmConfig | None = None,
    silu_and_mul: bool = False,
) -> torch.Tensor:
    """x [T, H] (bf16 / fp16 / fp32), routing `weights` and expert `ids` [T, k] -> [T, H] in x's dtype:
    sum over k of weight * w2 @ activate(w13 @ x), every GEMM in block FP8 (see the module docstring).
    `activate` maps w13's output [R, N13] to w2's input [R, I]; `silu_and_mul` says it is silu(gate) * up
    of w13's halves, which the second quantization then computes itself (one launch, no [R, I] in
    memory)."""
    from sglang.srt.layers.moe.sort_combine import combine, sort_by_expert

    num_experts = w13.shape[0]
    rows = ids.numel()
    cfg = config or config_by_mean_rows(MOE_GEMM_CONFIGS, rows, num_experts)
    sorted_ = sort_by_expert(ids, num_experts, use_triton=True, block_ms=(cfg.block_m,))
    token_of, offs = sorted_.token_of, sorted_.offs
    tile_end = sorted_.tile_ends[0]
    xq, xs = per_token_group_quant_fp8(x, block_size[1])
    h = moe_gemm_fp8(xq, xs, w13, w13_scale, offs, rows, token_of, x.dtype, cfg, tile_end, block_size)
    if silu_and_mul:
        aq, as_ = per_token_group_quant_fp8(h, block_size[1], fuse_silu_and_mul=True)
    else:
        aq, as_ = per_token_group_quant_fp8(activate(h).contiguous(), block_size[1])
    y = moe_gemm_fp8(aq, as_, w2, w2_scale, offs, rows, None, x.dtype, cfg, tile_end, block_size)
    return combine(y, sorted_, weights, x.dtype)


def fused_experts_fp8_torch(
    x: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    activate: Callable[[torch.Tensor], torch.Tensor],
    block_size=(BLOCK, BLOCK),
) -> torch.Tensor:
    """The twin of `fused_experts_fp8`: per expert, its rows' quantized activations and its dequantized
    weights multiplied in float32 (one host read of the counts; CPU and tests)."""
    check_block_operands(w13, w13_scale, block_size)
    check_block_operands(w2, w2_scale, block_size)
    gk = block_size[1]
    xq, xs = per_token_group_quant_fp8_torch(x, gk)
    x_deq = dequantize_block_fp8(xq, xs, (1, gk))
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    for expert in torch.unique(flat).tolist():
        if expert >= w13.shape[0]:
            continue  # another EP rank's assignments (`RoutedExperts._local_assignments`)
        pos = (flat == expert).nonzero().squeeze(1)
        tokens = pos // top_k
        h = (x_deq[tokens] @ dequantize_block_fp8(w13[expert], w13_scale[expert], block_size).t()).to(x.dtype)
        aq, as_ = per_token_group_quant_fp8_torch(activate(h), gk)
        a_deq = dequantize_block_fp8(aq, as_, (1, gk))
        y = (a_deq @ dequantize_block_fp8(w2[expert], w2_scale[expert], block_size).t()).to(x.dtype)
        out.index_add_(0, tokens, y.float() * weights.reshape(-1)[pos, None].float())
    return out.to(x.dtype)
