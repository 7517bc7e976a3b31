"""One tensor-parallel rank's part of a Mamba2 mixer: which heads and groups it holds, and which rows of
each checkpoint tensor are its own.

Heads split evenly: rank r holds heads [r*H/tp, (r+1)*H/tp) (their x, z, dt, A_log, D, dt_bias, SSM
state and output-norm channels). The groups of B and C go with the heads that read them:
- `n_groups % tp == 0`: rank r holds groups [r*G/tp, (r+1)*G/tp), each exactly once;
- `tp % n_groups == 0` (Granite-4.0-H's, Bamba's and Falcon-H1's one group at any TP, two groups at
  TP 4): a group spans tp/G ranks, and each of them holds a copy of that one group (upstream pads the
  groups up to tp the same way, `extra_groups_for_head_shards`). The local layout is then one group
  read by every local head, so the kernels run unchanged on local sizes.
Any other split would put a rank's heads under groups it cannot hold whole; it is refused.

The conv channels are [x | B | C] and the input projection's rows [z | x | B | C | dt]: each piece is
split by its own rule, never the concatenation as one tensor (a split of the whole would hand rank 0
all of x and rank 1 B and C).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from sglang.srt.layers.linear import DimShard

Span = tuple[int, int]  # (first row, row count) of the full tensor


@dataclass(frozen=True)
class Mamba2Shards:
    num_heads: int  # the whole mixer's
    head_dim: int
    n_groups: int
    state_size: int
    tp_size: int = 1
    tp_rank: int = 0

    @classmethod
    def for_this_rank(cls, num_heads: int, head_dim: int, n_groups: int, state_size: int) -> Mamba2Shards:
        """The layout on this process's TP rank (`sglang.srt.distributed`); refuses a TP size the heads
        or groups do not split under."""
        tp = get_tensor_model_parallel_world_size()
        shards = cls(num_heads, head_dim, n_groups, state_size, tp, get_tensor_model_parallel_rank())
        shards.check()
        return shards

    def check(self) -> None:
        tp, h, g = self.tp_size, self.num_heads, self.n_groups
        if h % tp:
            raise ValueError(f"--tp-size {tp} does not divide the model's {h} Mamba2 heads.")
        if g % tp and tp % g:
            raise ValueError(
                f"--tp-size {tp} neither divides the model's {g} Mamba2 groups nor is a multiple of them."
            )

    @property
    def local_heads(self) -> int:
        return self.num_heads // self.tp_size

    @property
    def local_groups(self) -> int:
        return max(self.n_groups // self.tp_size, 1)

    @property
    def groups_replicated(self) -> bool:
        """Whether each group is held by several ranks (tp > n_groups)."""
        return self.n_groups % self.tp_size != 0

    @property
    def first_group(self) -> int:
        """The global index of this rank's first group."""
        if self.groups_replicated:
            return self.tp_rank // (self.tp_size // self.n_groups)
        return self.tp_rank * self.local_groups

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def local_intermediate(self) -> int:
        return self.local_heads * self.head_dim

    def _heads(self, base: int, per_head: int) -> Span:
        return base + self.tp_rank * self.local_heads * per_head, self.local_heads * per_head

    def _groups(self, base: int) -> Span:
        n = self.state_size
        return base + self.first_group * n, self.local_groups * n

    def conv_spans(self) -> list[Span]:
        """The rank's conv channels (conv1d weight / bias rows; conv state rows) in the full [x | B | C]."""
        i, gn = self.intermediate, self.n_groups * self.state_size
        return [self._heads(0, self.head_dim), self._groups(i), self._groups(i + gn)]

    def in_proj_spans(self) -> list[Span]:
        """The rank's rows of the full input projection [z | x | B | C | dt]."""
        i, gn = self.intermediate, self.n_groups * self.state_size
        conv = [(start + i, n) for start, n in self.conv_spans()]
        return [self._heads(0, self.head_dim), *conv, self._heads(2 * i + 2 * gn, 1)]

    def head_spans(self) -> list[Span]:
        """The rank's entries of a per-head tensor (A_log, D, dt_bias)."""
        return [self._heads(0, 1)]

    def channel_spans(self) -> list[Span]:
        """The rank's channels of the gated output (the norm's weight; out_proj's input columns)."""
        return [self._heads(0, self.head_dim)]

    def dim_shard(self, spans_of: str) -> SpanShard:
        """The loader's rule (`linear.DimShard`) for dimension 0 of a tensor split by `spans_of` (the name
        of one of the span methods above), every rank's spans written out."""
        ranks = [replace(self, tp_rank=r) for r in range(self.tp_size)]
        spans = tuple(tuple(getattr(s, spans_of)()) for s in ranks)
        full = sum(n for _, n in getattr(replace(self, tp_size=1, tp_rank=0), spans_of)())
        return SpanShard(0, (full,), self.tp_size, tuple(range(self.tp_size)), 0, spans)


@dataclass(frozen=True)
class SpanShard(DimShard):
    """A `DimShard` whose parts are given as rows of the full tensor per rank (`Mamba2Shards`): pieces
    split by different rules (heads and groups) or held by several ranks (replicated groups).

    The spans count in rows; `in_blocks(block)` (what an FP8 linear's scales get from
    `fp8.shard_fp8_like`, `block` the quantization config's weight_block_size) is the same rule over
    scale blocks, which needs every span to be whole blocks (else ValueError naming --tp-size)."""

    spans_of_part: tuple[tuple[Span, ...], ...] = ()
    block: int = 1  # rows per entry: 1 for the weight, the scale block for its scales

    def in_blocks(self, block: int) -> SpanShard:
        return replace(super().in_blocks(block), block=block)

    def _spans(self, part: int) -> tuple[Span, ...]:
        spans, block = self.spans_of_part[part], self.block
        if block == 1:
            return spans
        bad = next(((a, n) for a, n in spans if a % block or n % block), None)
        if bad is not None:
            raise ValueError(
                f"A Mamba2 projection's rows [{bad[0]}, {bad[0] + bad[1]}) on one rank are not whole "
                f"{block}-row FP8 scale blocks at --tp-size {len(self.part_of_rank)}."
            )
        return tuple((a // block, n // block) for a, n in spans)

    @property
    def local_size(self) -> int:
        return sum(n for _, n in self._spans(0))

    def positions(self, part: int) -> torch.Tensor:
        return torch.cat([torch.arange(start, start + n) for start, n in self._spans(part)])
