"""The MoE block's token bookkeeping around its grouped GEMMs in Triton, the CUDA path of
`RoutedExperts.forward_device` for decode-size batches: torch takes ~15 kernels per layer for it (a
stable argsort, gathers, a histogram, a cumsum, casts, a zero fill and an `index_add_`), these take three
(two where `moe_align_tiles` serves).

- `moe_align`: for the [T, k] expert ids, the stable sort by expert of the T * k assignments, as the
  token of each sorted row, the sorted position of each assignment (its inverse) and the grouped GEMM's
  `offs` (int32 cumulative counts per expert). Each position is the number of assignments before it in
  (expert, index) order: O((T k)^2) compares, which at decode sizes is far less than a launch costs.
- `moe_combine`: each token's output, the weighted sum of its k rows of the experts' output, summed in
  float32 in pick order and rounded once to the activation dtype (torch's form sums the same products
  with an `index_add_`). Rows of weight 0 add nothing whatever they hold (under expert parallelism, other
  ranks' assignments: id `num_experts`, sorted last, outside every group of `offs`, never computed).

- `moe_align_tiles`: `moe_align` and, for the fused GEMMs, their tile maps (`fused_moe_fp8_triton.tile_map`,
  the cumulative BLOCK_M tiles per expert, for one or two tile heights) in ONE launch, where a decode
  batch has at most MERGED_MAX_ASSIGNMENTS assignments: align's programs plus one more that counts the
  offsets and tiles of every expert (E x T k compares in one program: ~0.3M at 512 experts and 512
  assignments), where apart they take three launches (four with two heights). Eager forwards only: on
  an H200 it saved host time and cost device time (MERGED_MAX_ASSIGNMENTS), so a CUDA graph's body
  takes the launches apart.

On CPU tensors the kernels run only under `TRITON_INTERPRET=1`, for tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from sglang.srt.utils.triton_jit import add, jit_for_env

# Tiles of the compares: 32 assignments against 64 (BI x BJ) in `_align_kernel`, 32 experts against 64
# assignments in `_offsets_kernel`. At 128 x 128 (int64) the align kernel spilled 2,808 bytes per
# thread to local memory and the offsets kernel 312 (sm_90, `sglang.test.sm90` checks it); these keep
# 96 and 64 registers, and at decode sizes (T k = 128) make 4 programs where 128 made one.
_BI, _BJ, _BE = 32, 64, 32


def _align_block(ids_ptr, token_ptr, inv_ptr, n, block, TOP_K: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr):
    """Assignments [block * BI, (block + 1) * BI): each one's sorted position (the assignments before it
    in (expert, index) order) into inv, its token into token_of at that position."""
    i = block * BI + tl.arange(0, BI)
    mi = i < n
    e_i = tl.load(ids_ptr + i, mask=mi, other=0)
    pos = (i * 0).to(tl.int64)  # zeros made from i (tl.zeros is a jitted helper: triton_jit says why)
    for j0 in range(0, n, BJ):
        j = j0 + tl.arange(0, BJ)
        e_j = tl.load(ids_ptr + j, mask=j < n, other=0)
        before = (e_j[None, :] < e_i[:, None]) | ((e_j[None, :] == e_i[:, None]) & (j[None, :] < i[:, None]))
        pos += tl.reduce((before & (j[None, :] < n)).to(tl.int64), 1, add)
    tl.store(inv_ptr + i, pos, mask=mi)
    tl.store(token_ptr + pos, (i // TOP_K).to(tl.int64), mask=mi)


# Jitted at import, as a kernel's callee must be (jit_for_env hands interpreted kernels its interpreted form).
align_block = JITFunction(_align_block)


def _align_kernel(ids_ptr, token_ptr, inv_ptr, n, TOP_K: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr):
    align_block(ids_ptr, token_ptr, inv_ptr, n, tl.program_id(0), TOP_K, BI, BJ)


def _tile_ends(rows, i, carry, tile_ptr, e, m, BLOCK_M: tl.constexpr):
    """Stores carry + the inclusive sum of ceil(rows / BLOCK_M) over the chunk's experts at tile_ptr + e;
    returns the carry past the chunk."""
    tiles = (rows + BLOCK_M - 1) // BLOCK_M
    inclusive = tl.reduce(tl.where(i[None, :] <= i[:, None], tiles[None, :], 0), 1, add)
    tl.store(tile_ptr + e, carry + inclusive, mask=m)
    return carry + tl.reduce(tiles, 0, add)


tile_ends = JITFunction(_tile_ends)


def _align_tiles_kernel(
    ids_ptr, token_ptr, inv_ptr, offs_ptr, tile1_ptr, tile2_ptr, n, ALIGN_PROGRAMS,
    TOP_K: tl.constexpr, E: tl.constexpr, BI: tl.constexpr, BJ: tl.constexpr, BE: tl.constexpr,
    BM1: tl.constexpr, BM2: tl.constexpr,
):  # fmt: skip
    """Programs below ALIGN_PROGRAMS: `_align_kernel`'s. The last: offs and the tile maps of BM1 (and of
    BM2, where it is not 0), BE experts at a time, each expert's rows counted over every assignment."""
    pid = tl.program_id(0)
    if pid < ALIGN_PROGRAMS:
        align_block(ids_ptr, token_ptr, inv_ptr, n, pid, TOP_K, BI, BJ)
    else:
        i = tl.arange(0, BE)
        carry1 = pid * 0
        carry2 = pid * 0
        for e0 in range(0, E, BE):
            e = e0 + i
            upto = (e * 0).to(tl.int32)  # assignments of experts <= e, and < e
            below = (e * 0).to(tl.int32)
            for j0 in range(0, n, BJ):
                j = j0 + tl.arange(0, BJ)
                e_j = tl.load(ids_ptr + j, mask=j < n, other=E)  # masked lanes count for no expert
                upto += tl.reduce((e_j[None, :] <= e[:, None]).to(tl.int32), 1, add)
                below += tl.reduce((e_j[None, :] < e[:, None]).to(tl.int32), 1, add)
            m = e < E
            tl.store(offs_ptr + e, upto, mask=m)
            rows = tl.where(m, upto - below, 0)
            carry1 = tile_ends(rows, i, carry1, tile1_ptr, e, m, BM1)
            if BM2 != 0:
                carry2 = tile_ends(rows, i, carry2, tile2_ptr, e, m, BM2)


def _offsets_kernel(ids_ptr, offs_ptr, n, E: tl.constexpr, BE: tl.constexpr, BJ: tl.constexpr):
    e = tl.program_id(0) * BE + tl.arange(0, BE)
    total = (e * 0).to(tl.int32)
    for j0 in range(0, n, BJ):
        j = j0 + tl.arange(0, BJ)
        e_j = tl.load(ids_ptr + j, mask=j < n, other=E)  # masked lanes count for no expert
        total += tl.reduce((e_j[None, :] <= e[:, None]).to(tl.int32), 1, add)
    tl.store(offs_ptr + e, total, mask=e < E)


def _align_outputs(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, ...]:
    """(ids flat and contiguous, token_of [T k] int64, inv [T k] int64, offs [E] int32) for an align launch."""
    n, device = ids.numel(), ids.device
    flat = ids.reshape(-1).contiguous()
    token_of, inv = torch.empty(n, dtype=torch.int64, device=device), torch.empty(n, dtype=torch.int64, device=device)
    return flat, token_of, inv, torch.empty(num_experts, dtype=torch.int32, device=device)


def moe_align(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [T, k] int64 -> (token of each sorted row [T k] int64, sorted position of each assignment in
    row-major [T, k] order [T k] int64, offs [E] int32)."""
    n = ids.numel()
    flat, token_of, inv, offs = _align_outputs(ids, num_experts)
    if n:
        jit_for_env(_align_kernel)[(triton.cdiv(n, _BI),)](
            flat, token_of, inv, n, TOP_K=ids.shape[1], BI=_BI, BJ=_BJ
        )
    be = min(_BE, triton.next_power_of_2(num_experts))
    jit_for_env(_offsets_kernel)[(triton.cdiv(num_experts, be),)](flat, offs, n, E=num_experts, BE=be, BJ=_BJ)
    return token_of, inv, offs


# The one-launch bookkeeping (`moe_align_tiles`) serves eager forwards' batches of at most this many
# assignments (the last program's compares grow as E x T k: the 80B's batches of up to 46 tokens); a
# CUDA graph's body (its warm-up and capture, `utils.graph_capture`) takes the three launches. On an
# H200 (2026-12-01, `bench_kernels.py --moe`, the 80B's MoE layer with its shared expert) the one launch
# cost the device more, 0.0682 / 0.1672 ms at 1 / 8 tokens against 0.0603 / 0.1584 ms (likely its last
# program, which recounts every expert's rows in 9 sequential chunks of 64, where the offsets kernel
# spreads them over 9 programs and tile_map reads them; 64 / 256 tokens are over this bound), and the
# host less: the layer launched eagerly took 0.48 / 0.62 ms against 0.58 / 0.59 ms (two Triton launches
# fewer; eager timings vary by ~0.03 ms run to run).
MERGED_MAX_ASSIGNMENTS = 512
# Experts per chunk of the merged kernel's last program (a BE x BJ compare tile, a BE x BE triangle).
_MERGED_BE = 64


def moe_align_tiles(
    ids: torch.Tensor, num_experts: int, block_ms: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]]:
    """`moe_align`'s (token_of, inv, offs) and the tile maps of the one or two tile heights `block_ms`
    (`fused_moe_fp8_triton.tile_map`'s values for each), in one launch (at most MERGED_MAX_ASSIGNMENTS
    assignments: the caller checks; eager forwards only: MERGED_MAX_ASSIGNMENTS says why)."""
    n = ids.numel()
    assert n <= MERGED_MAX_ASSIGNMENTS and 1 <= len(block_ms) <= 2
    flat, token_of, inv, offs = _align_outputs(ids, num_experts)
    tiles = tuple(torch.empty_like(offs) for _ in block_ms)
    programs = triton.cdiv(n, _BI)
    be = min(_MERGED_BE, triton.next_power_of_2(num_experts))
    jit_for_env(_align_tiles_kernel)[(programs + 1,)](
        flat, token_of, inv, offs, tiles[0], tiles[-1], n, programs, TOP_K=ids.shape[1], E=num_experts,
        BI=_BI, BJ=_BJ, BE=be, BM1=block_ms[0], BM2=block_ms[1] if len(block_ms) == 2 else 0,
    )  # fmt: skip
    return token_of, inv, offs, tiles


def _combine_kernel(y_ptr, inv_ptr, w_ptr, out_ptr, H: tl.constexpr, TOP_K: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BH + tl.arange(0, BH)
    mh = h < H
    acc = h.to(tl.float32) * 0.0
    for j in tl.static_range(TOP_K):
        row = tl.load(inv_ptr + t * TOP_K + j)
        w = tl.load(w_ptr + t * TOP_K + j).to(tl.float32)
        # A weight-0 row adds nothing, whatever it holds, and is not read: other EP ranks' rows are never
        # computed (under EP most of a token's rows).
        used = mh & ((h * 0.0 + w) != 0.0)  # (w as a vector: the interpreter ands no scalar with one)
        y = tl.load(y_ptr + row * H + h, mask=used, other=0.0).to(tl.float32)
        acc += y * w
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=mh)


def moe_combine(
    y: torch.Tensor, inv: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """y [T k, H] the experts' output in sorted order, inv [T k] (from `moe_align`), weights [T, k] ->
    [T, H] in `dtype`: each token's weighted sum of its rows."""
    t, top_k = weights.shape
    hidden = y.shape[1]
    out = torch.empty(t, hidden, dtype=dtype, device=y.device)
    if t:
        bh = min(1024, triton.next_power_of_2(hidden))
        jit_for_env(_combine_kernel)[(t, triton.cdiv(hidden, bh))](
            y.contiguous(), inv, weights.contiguous(), out, H=hidden, TOP_K=top_k, BH=bh
        )
    return out
