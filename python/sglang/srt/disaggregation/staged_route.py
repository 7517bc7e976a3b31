"""Where a prefill rank's staged chunks go (`Staging.send`): the decode ranks' staging ranges.

At the same --tp-size a chunk is one block, packed by this rank (`StatePacker.pack`: every KV buffer's
rows of the chunk's positions, buffer after buffer, then the state's rows) and written whole into the
range of the decode rank of the same index, which unpacks it with its own packer.

At another --tp-size the decode rank's block holds other heads: it is laid out as that decode rank packs
its own rows, and each of its units (KV heads, conv channels, SSM heads: `shard_map.py`) is written by one
prefill rank, from that rank's packed block. A packed block is laid out like pools of one token slot and
one state slot (`packed`): a KV buffer's part is head-major (`StatePacker`), so it is one "row" whose unit
is one head of every position of the chunk; the state's rows follow. `shard_map.shard_writes` gives the
copies between the blocks as between pools: one per KV buffer and run of heads, and per state buffer and
run of units, however many positions the chunk holds (token-major rows made it one per position: 75-98x
the time through Mooncake TCP, `benchmark/bench_pd_staging.py`). Every prefill rank packs
and writes each chunk, and the chunk is announced to the decode ranks once every prefill rank has
written it (`PdRanks.written_everywhere`), as at the same --tp-size; a chunk must fit this rank's buffer
and every decode rank's range (`chunk_plan_within`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sglang.srt.disaggregation.pd_ranks import rank_targets
from sglang.srt.disaggregation.shard_map import Segments, ShardLayout, shard_writes
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
        token = [0] if m else []  # (the chunk's positions are one row: `packed`)
        out = shard_writes(
            tp_rank, list(zip(blocks, chunk_shards(src_shards, m), strict=True)),
            list(zip(into, chunk_shards(dst_shards, m), strict=True)), token, token, 0, 0,
        )  # fmt: skip
        return [(targets[d]["session"], descriptors) for d, descriptors in out]

    return StagedRoute(sides, writes)


def packed(pool: PoolLayout, start: int, positions: int, state: bool) -> PoolLayout:
    """The layout of a block `StatePacker.pack` writes at `start` from pools laid out as `pool`: each KV
    buffer's `positions` rows in turn, head-major, then (`state`) each state buffer's row; as pools of one
    token slot (slot 0: a KV buffer's part of the block is one row, a head of every position one unit of
    it: `chunk_shards`) and one state slot (slot 0)."""
    row = positions * pool.kv_bytes_per_token
    kv_ptrs = [start + b * row for b in range(len(pool.kv_ptrs))]
    at, state_ptrs = start + len(pool.kv_ptrs) * row, []
    for size in pool.state_slot_bytes if state else []:
        state_ptrs.append(at)
        at += size
    sizes = list(pool.state_slot_bytes) if state else []
    return replace(pool, kv_ptrs=kv_ptrs, kv_nbytes=[row] * len(kv_ptrs), kv_bytes_per_token=row,
                   state_ptrs=state_ptrs, state_nbytes=sizes, state_slot_bytes=sizes)  # fmt: skip


def chunk_shards(shards: list[ShardLayout], positions: int) -> list[ShardLayout]:
    """The shard layouts of `packed` blocks of `positions` positions: a KV unit (one head) is that head's
    row of every position."""
    return [replace(s, kv=Segments(s.kv.runs, s.kv.unit_bytes * positions)) for s in shards]
