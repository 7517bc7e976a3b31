"""Where a prefill rank's staged chunks go (`Staging.send`): the decode ranks' staging ranges.

At the same --tp-size a chunk is one block, packed by this rank (`StatePacker.pack`: every KV buffer's
rows of the chunk's positions, buffer after buffer, then the state's rows) and written whole into the
range of the decode rank of the same index, which unpacks it with its own packer.

At another --tp-size the decode rank's block holds other heads: it is laid out as that decode rank packs
its own rows, and each of its units (KV heads, conv channels, SSM heads: `shard_map.py`) is written by one
prefill rank, from that rank's packed block. A packed block is laid out like the pools it comes from (row
t of KV buffer b at the block's start + (b * positions + t) * row bytes; the state's rows after), so
`shard_map.shard_writes` gives the copies between the blocks as between pools. Every prefill rank packs
and writes each chunk, and the chunk is announced to the decode ranks once every prefill rank has
written it (`PdRanks.written_everywhere`), as at the same --tp-size; a chunk must fit this rank's buffer
and every decode rank's range (`chunk_plan_within`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sglang.srt.disaggregation.pd_ranks import rank_targets
from sglang.srt.disaggregation.shard_map import ShardLayout, shard_writes
from sglang.srt.disaggregation.transfer import Descriptor, PoolLayout

if TYPE_CHECKING:
    from sglang.srt.disaggregation.staging import Staging

Sides = tuple[tuple[int, int, int], ...]  # (a position's bytes, the state's bytes, range bytes) per decode rank
Writes = Callable[[int, int, int, bool], list[tuple[str, list[Descriptor]]]]


@dataclass(frozen=True)
class StagedRoute:
    decode: Sides
    # (this rank's packed block's address, its positions, its bytes, whether it holds the state) -> the
    # writes (decode rank's session, copies) that move it
    writes: Writes

    def sides(self, own: tuple[int, int, int]) -> list[tuple[int, int, int]]:
        """What a chunk must fit: this rank's buffer (`own`) and every decode rank's range."""
        return [own, *self.decode]


def staged_route(layouts: list[PoolLayout], dst: dict[str, Any], tp_rank: int, staging: Staging) -> StagedRoute:
    """Prefill rank `tp_rank`'s route for one destination (`layouts`: every prefill rank's pools; the
    destination was checked by `check_targets`: at another --tp-size every rank's shard layout is this
    model's own)."""
    targets = rank_targets(dst)
    if len(targets) == len(layouts):
        mine = targets[tp_rank]
        session, address, nbytes = mine["session"], mine["staging"], mine["staging_bytes"]
        packer = staging.packer
        side = ((sum(packer.kv_row_bytes), sum(packer.state_bytes), nbytes),)
        return StagedRoute(side, lambda src, m, n, state: [(session, [(src, address, n)])])
    theirs = [PoolLayout.from_dict(t["layout"]) for t in targets]
    sides = tuple(
        (layout.kv_bytes_per_token * len(layout.kv_ptrs), sum(layout.state_slot_bytes), t["staging_bytes"])
        for layout, t in zip(theirs, targets, strict=True)
    )
    src_shards = [ShardLayout.from_dict(layout.shards) for layout in layouts]
    dst_shards = [ShardLayout.from_dict(layout.shards) for layout in theirs]

    def writes(src: int, m: int, n: int, state: bool) -> list[tuple[str, list[Descriptor]]]:
        blocks = [packed(layout, src if r == tp_rank else 0, m, state) for r, layout in enumerate(layouts)]
        into = [packed(layout, t["staging"], m, state) for layout, t in zip(theirs, targets, strict=True)]
        out = shard_writes(
            tp_rank, list(zip(blocks, src_shards, strict=True)), list(zip(into, dst_shards, strict=True)),
            list(range(m)), list(range(m)), 0, 0,
        )  # fmt: skip
        return [(targets[d]["session"], descriptors) for d, descriptors in out]

    return StagedRoute(sides, writes)


def packed(pool: PoolLayout, start: int, positions: int, state: bool) -> PoolLayout:
    """The layout of a block `StatePacker.pack` writes at `start` from pools laid out as `pool`: each KV
    buffer's rows of `positions` positions in turn, then (`state`) each state buffer's row, as pools of
    `positions` token slots and one state slot (slot 0)."""
    row = pool.kv_bytes_per_token
    kv_ptrs = [start + b * positions * row for b in range(len(pool.kv_ptrs))]
    at, state_ptrs = start + len(pool.kv_ptrs) * positions * row, []
    for size in pool.state_slot_bytes if state else []:
        state_ptrs.append(at)
        at += size
    sizes = list(pool.state_slot_bytes) if state else []
    return replace(pool, kv_ptrs=kv_ptrs, kv_nbytes=[positions * row] * len(kv_ptrs), state_ptrs=state_ptrs,
                   state_nbytes=sizes, state_slot_bytes=sizes)  # fmt: skip
