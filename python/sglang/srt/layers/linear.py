"""Tensor-parallel linear layers at upstream's names, and the sharding rule every sharded parameter carries.

Layers (all `nn.Linear` subclasses, so at TP 1 they are plain linears: same parameters, same forward,
what the FP8 swap, the CPU decode blocks and weight updates already handle):
- `ColumnParallelLinear(input, output)`: each rank holds a block of the output rows; its output is this
  rank's slice. `output_sizes=[a, b, ...]`: the rows are pieces
  (a fused projection, a conv over q | k | v) and each piece is split on its own, so a rank holds the
  same part of every piece, in piece order. `parts` < tp: each part is held by tp / parts ranks
  (attention key/value heads replicated where tp exceeds their count).
- `MergedColumnParallelLinear(input, [a, b, ...])`: the same with pieces (upstream's gate_up).
- `RowParallelLinear(input, output)`: each rank holds a block of the input columns and takes the
  matching slice of the activations; the partial products are summed over the TP group (all-reduce)
  unless `reduce_results=False` (a caller that sums several of them once, a MoE block). The bias is
  added once: after the sum, or without it on rank 0 only (so the caller's sum holds it once).
- `ReplicatedLinear`: every rank holds the whole weight (routers, small gates).

The sharding rule (what the loader uses; the Mamba2 models use it too). A sharded parameter carries
`param.tp_shards`, a tuple of `DimShard`s set with `set_weight_shards(param, *shards)`; each says, for
one dimension, which rows of the checkpoint's full tensor this rank holds. The loader gives every
parameter the checkpoint's full tensor; `shard_weight(param, full)` is this rank's part (the identity for
an unsharded parameter), `full_shape(param)` the checkpoint's shape, and `gather_weight(param, local)`
the full tensor again from every rank's part (a collective: every TP rank calls it). A module whose
parameter is not a linear's (a conv1d weight, A_log) shards it with `column_shard`/`set_weight_shards`
in its constructor. Parameters keep the checkpoint's names; `registry.materialize` carries the rule
over to the real parameters.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import (
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
)


@dataclass(frozen=True)
class DimShard:
    """Dimension `dim` of the full tensor is `pieces` (their sizes) after one another, plus `pad` zero rows
    after the last one (a vocabulary padded to a multiple of the TP size); every piece (the padded last one
    included) splits into `parts` equal parts, and TP rank r holds part `part_of_rank[r]` of each."""

    dim: int
    pieces: tuple[int, ...]
    parts: int
    part_of_rank: tuple[int, ...]
    pad: int = 0

    @property
    def part(self) -> int:
        return self.part_of_rank[get_tensor_model_parallel_rank()]

    @property
    def full_size(self) -> int:
        return sum(self.pieces)

    @property
    def local_size(self) -> int:
        return (self.full_size + self.pad) // self.parts

    def in_blocks(self, block: int) -> DimShard:
        """The same rule over `block`-row scale blocks (an FP8 weight's scales; whole blocks checked by
        the caller)."""
        return replace(self, pieces=tuple(p // block for p in self.pieces), pad=self.pad // block)

    def positions(self, part: int) -> torch.Tensor:
        """Indices into the (padded) full dimension that part `part` holds, in its local order."""
        sizes = list(self.pieces)
        sizes[-1] += self.pad
        out, start = [], 0
        for size in sizes:
            step = size // self.parts
            out.append(torch.arange(start + part * step, start + (part + 1) * step))
            start += size
        return torch.cat(out)


def column_shard(
    dim: int,
    pieces: list[int] | tuple[int, ...],
    parts: int | None = None,
    what: str = "a layer",
    pad: int = 0,
) -> DimShard:
    """This TP group's split of dimension `dim` into `parts` (default: the TP size; fewer: each part
    replicated on tp / parts consecutive ranks). ValueError naming --tp-size where it does not divide."""
    tp = get_tensor_model_parallel_world_size()
    parts = tp if parts is None else parts
    if tp % parts != 0:
        raise ValueError(f"{what} splits {parts} ways, which --tp-size {tp} is not a multiple of.")
    sizes = list(pieces)
    sizes[-1] += pad
    bad = [s for s in sizes if s % parts]
    if bad:
        raise ValueError(f"{what} has a size {bad[0]} that --tp-size {tp} does not divide ({parts} parts).")
    return DimShard(dim, tuple(pieces), parts, tuple(r * parts // tp for r in range(tp)), pad)


def set_weight_shards(param: torch.Tensor, *shards: DimShard) -> None:
    """Mark `param` as holding this rank's part of the checkpoint's tensor (no-op for one-part shards)."""
    kept = tuple(s for s in shards if s.parts > 1)
    if kept:
        param.tp_shards = kept


def weight_shards(param: torch.Tensor) -> tuple[DimShard, ...]:
    return getattr(param, "tp_shards", ())


def full_shape(param: torch.Tensor) -> tuple[int, ...]:
    """The checkpoint tensor's shape for `param`."""
    shape = list(param.shape)
    for s in weight_shards(param):
        shape[s.dim] = s.full_size
    return tuple(shape)


def shard_weight(param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's part of the checkpoint tensor `full` (shape `full_shape(param)`; the caller checks)."""
    return shard_tensor(full, weight_shards(param))


def shard_tensor(full: torch.Tensor, shards: tuple[DimShard, ...]) -> torch.Tensor:
    """This rank's part of `full` under `shards`."""
    for s in shards:
        if s.pad:
            pad_shape = list(full.shape)
            pad_shape[s.dim] = s.pad
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=s.dim)
        full = full.index_select(s.dim, s.positions(s.part).to(full.device))
    return full


def gather_weight(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The full tensor from every TP rank's `local` part of it (every rank calls this)."""
    shards = weight_shards(param)
    if not shards:
        return local
    tp = get_tp_group()
    parts = tp.all_gather(local.unsqueeze(0).contiguous(), dim=0)
    shape = list(local.shape)
    for s in shards:
        shape[s.dim] = s.full_size + s.pad
    full = local.new_zeros(shape)
    for r in range(tp.world_size):
        index = []
        for d in range(local.dim()):
            s = next((s for s in shards if s.dim == d), None)
            pos = s.positions(s.part_of_rank[r]) if s else torch.arange(local.shape[d])
            view = [1] * local.dim()
            view[d] = -1
            index.append(pos.to(local.device).view(view))
        full[tuple(index)] = parts[r]
    for s in shards:
        full = full.narrow(s.dim, 0, s.full_size)
    return full


class ReplicatedLinear(nn.Linear):
    """The whole weight on every rank (upstream's name for a linear TP leaves alone)."""


class ColumnParallelLinear(nn.Linear):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        output_sizes: list[int] | None = None,
        parts: int | None = None,
        what: str = "a column-parallel linear",
    ):
        pieces = list(output_sizes) if output_sizes else [output_size]
        assert sum(pieces) == output_size, (pieces, output_size)
        shard = column_shard(0, pieces, parts, what)
        super().__init__(input_size, shard.local_size, bias=bias)
        self.output_sizes = pieces
        set_weight_shards(self.weight, shard)
        if self.bias is not None:
            set_weight_shards(self.bias, shard)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused in one weight, each split on its own (upstream's name)."""

    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False, **kw):
        super().__init__(input_size, sum(output_sizes), bias, output_sizes=output_sizes, **kw)


class RowParallelLinear(nn.Linear):
    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        *,
        reduce_results: bool = True,
        input_sizes: list[int] | None = None,
        what: str = "a row-parallel linear",
    ):
        shard = column_shard(1, list(input_sizes) if input_sizes else [input_size], None, what)
        super().__init__(shard.local_size, output_size, bias=bias)
        self.reduce_results = reduce_results
        set_weight_shards(self.weight, shard)
        self.tp_size = get_tensor_model_parallel_world_size()
        # Unreduced, the caller sums the ranks' outputs: rank 0's alone carries the bias.
        self.adds_bias = reduce_results or get_tensor_model_parallel_rank() == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight)
        if self.reduce_results:
            y = get_tp_group().all_reduce(y)
        return y if self.bias is None or not self.adds_bias else y + self.bias
