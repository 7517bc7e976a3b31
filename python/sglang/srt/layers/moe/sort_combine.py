"""The routed experts' bookkeeping that every grouped path shares (`RoutedExperts.forward_device`, the
FP8 experts of `fused_moe_fp8_triton.py` and the 16-bit fused GEMMs of `fused_moe_triton.py`): the
(token, expert) assignments sorted by expert, and each token's rows of the experts' output combined with
its routing weights. No host read either way (a CUDA graph can capture both).

Where the Triton bookkeeping serves (`use_triton`, decode sizes up to ALIGN_MAX_ASSIGNMENTS) the sort
is `dispatch_triton.moe_align` (two launches; in an eager forward's decode batches one with the fused
GEMMs' tile maps, `moe_align_tiles`: a graph's body takes them apart, `utils/graph_capture.py`);
elsewhere torch's stable argsort and a histogram. The
combine reads each token's rows in pick order (`dispatch_triton.moe_combine` on CUDA or where the Triton
sort served, a torch loop over the picks elsewhere), sums them in float32 and rounds once to the
activation dtype; no atomic adds, so the same bits every run. Other EP ranks' assignments (id
`num_experts`) sort last, outside every group of `offs`, and add nothing (their weight is 0, their rows
are never computed)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from sglang.srt.utils.graph_capture import in_graph_body

# The Triton bookkeeping (`dispatch_triton.py`) serves batches of at most this many assignments: its
# compares grow as their square; 4,096 (256 tokens x top-16) is 16M compares, a few us on a GPU.
ALIGN_MAX_ASSIGNMENTS = 4096


class SortedAssignments(NamedTuple):
    """The T k assignments in (expert, pick) order: `token_of` [T k] int64, the token of each sorted row;
    `offs` [E] int32, the cumulative rows per local expert; `inv` [T k] int64, the sorted row of each
    assignment (Triton bookkeeping), or `order` [T k] int64, the assignment of each sorted row (torch)."""

    token_of: torch.Tensor
    offs: torch.Tensor
    inv: torch.Tensor | None
    order: torch.Tensor | None
    # The tile maps of the `block_ms` asked for, where the one-launch bookkeeping made them; else None.
    tile_ends: tuple[torch.Tensor, ...] | None = None


def sort_by_expert(
    ids: torch.Tensor, num_experts: int, use_triton: bool, block_ms: tuple[int, ...] = ()
) -> SortedAssignments:
    """ids [T, k] (local expert ids; `num_experts` for other EP ranks' assignments) sorted by expert,
    stably. `use_triton`: the Triton bookkeeping where the batch is small enough for it (imported here:
    a CPU install may lack triton). `block_ms` (the fused GEMMs' one or two tile heights): their tile
    maps too (`tile_ends`): in an eager forward's small batches from the sort's own launch
    (`dispatch_triton.moe_align_tiles`: less host time), else (a CUDA graph's body: less device time,
    `utils.graph_capture`) one `tile_map` launch each."""
    if use_triton and ids.numel() <= ALIGN_MAX_ASSIGNMENTS:
        from sglang.srt.layers.moe import dispatch_triton

        if block_ms and ids.numel() <= dispatch_triton.MERGED_MAX_ASSIGNMENTS and not in_graph_body(ids.device):
            token_of, inv, offs, tiles = dispatch_triton.moe_align_tiles(ids, num_experts, block_ms)
            return SortedAssignments(token_of, offs, inv, None, tiles)
        token_of, inv, offs = dispatch_triton.moe_align(ids, num_experts)
        return _with_tile_maps(SortedAssignments(token_of, offs, inv, None), block_ms)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # One more bucket for other EP ranks' assignments (id num_experts), left out of the offsets.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.index_add_(0, flat, torch.ones_like(flat))
    offs = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    return _with_tile_maps(SortedAssignments(order // ids.shape[1], offs, None, order), block_ms)


def _with_tile_maps(sorted_: SortedAssignments, block_ms: tuple[int, ...]) -> SortedAssignments:
    if not block_ms:
        return sorted_
    from sglang.srt.layers.moe.fused_moe_fp8_triton import tile_map

    return sorted_._replace(tile_ends=tuple(tile_map(sorted_.offs, bm) for bm in block_ms))


def combine(
    y: torch.Tensor, sorted_: SortedAssignments, weights: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """y [T k, H], the experts' output in sorted order (rows past offs[-1] may hold anything) -> [T, H] in
    `dtype`: each token's rows times their routing `weights` [T, k], summed in float32 in pick order and
    rounded once. The same bits from run to run on every device: a token's rows are read, never
    scattered with atomic adds (on CUDA `index_add_`'s order changes between runs, and with it the
    float32 sum's last bits: the 80B's experts at 1,024 tokens differed run to run on an H200)."""
    inv = sorted_.inv
    if inv is None:
        inv = torch.empty_like(sorted_.order)
        inv[sorted_.order] = torch.arange(inv.numel(), device=inv.device)
    if y.is_cuda or sorted_.inv is not None:
        from sglang.srt.layers.moe import dispatch_triton

        return dispatch_triton.moe_combine(y, inv, weights, dtype)
    t, top_k = weights.shape
    rows = y.index_select(0, inv).view(t, top_k, y.shape[1])  # assignment (token, pick) order
    weights = weights.float()
    out = torch.zeros(t, y.shape[1], dtype=torch.float32, device=y.device)
    for j in range(top_k):
        out += weighted_rows(rows[:, j], weights[:, j])
    return out.to(dtype)


def weighted_rows(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Each row of the experts' output times its routing weight, in float32; rows of weight 0 give 0
    whatever they hold (other EP ranks' rows, which the grouped GEMMs leave unwritten)."""
    return torch.where(weight[:, None] != 0, y.float() * weight[:, None], 0.0)
