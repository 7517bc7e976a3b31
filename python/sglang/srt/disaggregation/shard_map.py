"""Where each TP rank's KV heads and recurrent-state rows sit in the model's global (TP 1) layout, and the
copies that move one request between a prefill and a decode server of different --tp-size.

A rank's pools hold, per token (KV) or per slot (state), one row of units along one axis:
- kv: key/value heads, `head_dim` elements each (every K and V buffer, the MTP draft layer's too);
- conv: conv channels of TP 1's conv state (Gated DeltaNet's q | k | v, Mamba2's x | B | C, LFM2's
  hidden channels), `conv_kernel - 1` elements each;
- ssm: SSM heads, a [head_dim, state] block each (LFM2's unread 8-element row is one unit every rank holds).
`Segments` lists the global units a rank holds in its row's order, as runs; which units those are is the
model's own rule (`HybridArchConfig.kv_head_units` and `state_units`, the layers' sharding). Units split
over the ranks, or are replicated where the TP size exceeds their count (KV heads, Mamba2 groups).

`shard_writes` gives one prefill rank's copies of one request into every decode rank: each unit of each
decode rank is written by exactly one prefill rank (the one of the same index where it holds the unit,
else the lowest that does), so no destination byte is written twice. Adjacent units of one row merge
into one copy, and whole rows of consecutive slots do: between ranks holding the same units (equal
--tp-size) the copies are `transfer.transfer_descriptors`'.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache, lru_cache, partial
from typing import Any

import torch

from sglang.srt.disaggregation.state_packer import kv_buffers
from sglang.srt.disaggregation.transfer import Descriptor, PoolLayout, token_runs

Run = tuple[int, int]  # (first global unit, unit count), in this rank's local order
Piece = tuple[int, int, int]  # (first source unit, first destination unit, count), in local offsets

# Per axis, in a layout from the network: a rank's units are at most three runs (q | k | v, x | B | C); a
# peer's layout is also checked against the model's own (`rank_layouts`) before anything is built from it.
MAX_RUNS = 16
MAX_UNITS = 1 << 40  # a bound on any unit index, count or size a peer sends
AXES = ("kv", "conv", "ssm")
_WHAT = {"kv": "KV heads", "conv": "conv-state channels", "ssm": "SSM-state heads"}


@dataclass(frozen=True)
class Segments:
    runs: tuple[Run, ...]  # the units this rank holds along the axis, in local order (contiguous local rows)
    unit_bytes: int  # bytes of one unit in one row

    @classmethod
    def of(cls, runs: list[Run] | tuple[Run, ...], unit_bytes: int) -> Segments:
        """Runs with the empty ones dropped and adjacent ones merged (TP 1's q | k | v is one run)."""
        merged: list[Run] = []
        for start, n in runs:
            if n == 0:
                continue
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        return cls(tuple(merged), unit_bytes)

    @property
    def units(self) -> int:
        return sum(n for _, n in self.runs)

    @property
    def row_bytes(self) -> int:
        return self.units * self.unit_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"runs": [list(r) for r in self.runs], "unit_bytes": self.unit_bytes}

    @classmethod
    def from_dict(cls, d: Any, what: str) -> Segments:
        if not isinstance(d, dict) or set(d) != {"runs", "unit_bytes"}:
            raise ValueError(f"{what} must be an object with exactly 'runs' and 'unit_bytes'.")
        runs, unit = d["runs"], _count(d["unit_bytes"], f"{what}.unit_bytes")
        if unit == 0:
            raise ValueError(f"{what}.unit_bytes must be positive.")
        if not isinstance(runs, list) or len(runs) > MAX_RUNS:
            raise ValueError(f"{what}.runs must be a list of at most {MAX_RUNS} [first, count] pairs.")
        pairs = []
        for r in runs:
            if not isinstance(r, list) or len(r) != 2:
                raise ValueError(f"{what}.runs must hold [first, count] pairs.")
            pairs.append((_count(r[0], f"{what}.runs"), _count(r[1], f"{what}.runs")))
        spans = sorted(pairs)
        if any(a + n > b for (a, n), (b, _) in zip(spans, spans[1:], strict=False)):
            raise ValueError(f"{what}.runs name a unit twice.")
        return cls.of(pairs, unit)


def _count(v: Any, what: str) -> int:
    if type(v) is not int or not 0 <= v < MAX_UNITS:
        raise ValueError(f"{what} must hold integers in [0, 2**40).")
    return v


@dataclass(frozen=True)
class ShardLayout:
    kv: Segments  # one token's row in every KV buffer (K or V of one full-attention layer, the MTP layer's)
    conv: Segments  # one slot's row in every conv-state buffer
    ssm: Segments  # one slot's row in every SSM-state buffer

    def to_dict(self) -> dict[str, Any]:
        return {axis: getattr(self, axis).to_dict() for axis in AXES}

    @classmethod
    def from_dict(cls, d: Any) -> ShardLayout:
        """ValueError naming the field where `d` (from the network) is not a layout."""
        if not isinstance(d, dict) or set(d) != set(AXES):
            raise ValueError(f"A shard layout must be an object with exactly {', '.join(AXES)}.")
        return cls(*(Segments.from_dict(d[axis], axis) for axis in AXES))


def rank_layout(arch, tp_size: int, tp_rank: int, kv_unit: int, conv_unit: int, ssm_unit: int) -> ShardLayout:
    """Rank `tp_rank` of `tp_size`'s layout for the model `arch` (`HybridArchConfig`), with the bytes of
    one unit on each axis (they follow the pools' dtypes)."""
    conv, ssm = arch.state_units(tp_size, tp_rank)
    return ShardLayout(
        Segments.of(arch.kv_head_units(tp_size, tp_rank), kv_unit),
        Segments.of(conv, conv_unit),
        Segments.of(ssm, ssm_unit),
    )


def rank_layouts(arch, tp_size: int, units: ShardLayout) -> list[ShardLayout]:
    """Every rank's layout at `tp_size` for the model `arch`, with the unit sizes of `units` (a rank's own
    layout: they do not depend on the TP size). ValueError where the model does not split over it."""
    sizes = (units.kv.unit_bytes, units.conv.unit_bytes, units.ssm.unit_bytes)
    return [rank_layout(arch, tp_size, r, *sizes) for r in range(tp_size)]


def model_rule(sched) -> Callable[[int], list[ShardLayout]]:
    """`rank_layouts` for the scheduler's model and pools: what its ranks at any TP size hold."""
    return partial(rank_layouts, sched.model_runner.arch, units=shard_layout(sched))


def pools_layout(arch, kv_pool, mamba_pool, tp_size: int, tp_rank: int) -> ShardLayout:
    """`rank_layout` with the unit sizes of these pools, checked against the rows they really hold."""
    kv = kv_buffers(kv_pool)
    conv_state, ssm_state = mamba_pool.conv_state, mamba_pool.ssm_state
    layout = rank_layout(
        arch,
        tp_size,
        tp_rank,
        arch.head_dim * kv_pool.dtype.itemsize,
        conv_state.shape[-1] * conv_state.element_size(),
        math.prod(ssm_state.shape[-2:]) * ssm_state.element_size(),
    )
    rows = {b[0].nbytes for b in kv}
    assert rows <= {layout.kv.row_bytes}, f"KV rows of {rows} bytes; the layout says {layout.kv.row_bytes}"
    assert conv_state.shape[2] == layout.conv.units, (tuple(conv_state.shape), layout.conv)
    assert ssm_state.shape[2] == layout.ssm.units, (tuple(ssm_state.shape), layout.ssm)
    return layout


def shard_layout(sched) -> ShardLayout:
    """This TP rank's layout, from the scheduler's model config, its TP size and rank and its pools."""
    from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    runner = sched.model_runner
    return pools_layout(
        runner.arch,
        runner.token_to_kv_pool,
        sched.req_to_token_pool.mamba_pool,
        get_tensor_model_parallel_world_size(),
        get_tensor_model_parallel_rank(),
    )


def _covered(layouts: list[ShardLayout], axis: str) -> list[Run]:
    """The units some rank holds, as sorted maximal runs."""
    out: list[Run] = []
    for start, n in sorted(r for lay in layouts for r in getattr(lay, axis).runs):
        if out and start <= out[-1][0] + out[-1][1]:
            end = max(out[-1][0] + out[-1][1], start + n)
            out[-1] = (out[-1][0], end - out[-1][0])
        else:
            out.append((start, n))
    return out


def layout_mismatch(prefill: list[ShardLayout], decode: list[ShardLayout]) -> str | None:
    """Why the decode ranks' pools cannot be filled from the prefill ranks' (another model, or other
    dtypes), else None. One sentence, for a client or a log."""
    if not prefill or not decode:
        return "a server of the pair sent no shard layout"
    for axis in AXES:
        mine = {getattr(lay, axis).unit_bytes for lay in prefill}
        theirs = {getattr(lay, axis).unit_bytes for lay in decode}
        if len(mine) > 1 or len(theirs) > 1:
            return (
                f"the TP ranks of one server weigh their {_WHAT[axis]} differently ({sorted(mine | theirs)})"
            )
        if mine != theirs:
            return (
                f"one of the {_WHAT[axis]} weighs {mine.pop()} bytes on the prefill server and "
                f"{theirs.pop()} on the decode server (another model, or another dtype)"
            )
        held, wanted = _covered(prefill, axis), _covered(decode, axis)
        if held != wanted:
            return (
                f"the prefill server's ranks hold the {_WHAT[axis]} {_spans(held)}, the decode server's "
                f"{_spans(wanted)} (another model)"
            )
    return None


def _spans(runs: list[Run]) -> str:
    return ", ".join(f"[{a}, {a + n})" for a, n in runs) or "none"


def _pieces(src: tuple[Segments, ...], dst: Segments, dst_rank: int) -> dict[int, list[Piece]]:
    """Per prefill rank, the pieces of decode rank `dst_rank`'s row along one axis it writes."""
    out: dict[int, list[Piece]] = {}
    held = [[(a, n, off) for (a, n), off in zip(s.runs, _offsets(s.runs), strict=True)] for s in src]
    for (start, n), dst_off in zip(dst.runs, _offsets(dst.runs), strict=True):
        cuts = {start, start + n}
        for runs in held:
            cuts.update(c for a, m, _ in runs for c in (a, a + m) if start < c < start + n)
        edges = sorted(cuts)
        for a, b in zip(edges, edges[1:], strict=False):
            holders = {
                r: off + a - first
                for r, runs in enumerate(held)
                for first, m, off in runs
                if first <= a < first + m
            }
            if not holders:
                raise ValueError(f"no prefill rank holds unit {a}")
            writer = dst_rank if dst_rank in holders else min(holders)
            piece = (holders[writer], dst_off + a - start, b - a)
            mine = out.setdefault(writer, [])
            if mine and mine[-1][0] + mine[-1][2] == piece[0] and mine[-1][1] + mine[-1][2] == piece[1]:
                mine[-1] = (mine[-1][0], mine[-1][1], mine[-1][2] + piece[2])
            else:
                mine.append(piece)
    return out


def _offsets(runs: tuple[Run, ...]) -> list[int]:
    out, off = [], 0
    for _, n in runs:
        out.append(off)
        off += n
    return out


@lru_cache(maxsize=64)
def _plan(
    src: tuple[ShardLayout, ...], dst: tuple[ShardLayout, ...]
) -> tuple[dict[str, dict[int, list[Piece]]], ...]:
    """Per decode rank, per axis, what each prefill rank writes (the same for every request of a pair)."""
    return tuple(
        {axis: _pieces(tuple(getattr(s, axis) for s in src), getattr(d, axis), r) for axis in AXES}
        for r, d in enumerate(dst)
    )


def _unitless(shard: ShardLayout) -> ShardLayout:
    return ShardLayout(*(Segments(getattr(shard, axis).runs, 1) for axis in AXES))


def check_rows(pool: PoolLayout, shard: ShardLayout, side: str) -> None:
    """ValueError where a rank's shard layout does not fill its pools' rows exactly."""
    half = len(pool.state_ptrs) // 2
    if len(pool.state_ptrs) % 2 or len(pool.state_slot_bytes) != len(pool.state_ptrs):
        raise ValueError(f"the {side} server's state buffers are not conv and SSM pairs")
    if pool.kv_ptrs and pool.kv_bytes_per_token != shard.kv.row_bytes:
        raise ValueError(f"the {side} server's KV rows and its shard layout differ in size")
    rows = [shard.conv.row_bytes] * half + [shard.ssm.row_bytes] * half
    if list(pool.state_slot_bytes) != rows:
        raise ValueError(f"the {side} server's state rows and its shard layout differ in size")


def _row_copies(
    pieces: list[Piece], unit: int, src: tuple[int, int], dst: tuple[int, int], runs: list, rows: Callable
) -> list[Descriptor]:
    """The copies of `pieces` of one buffer's rows: `src` / `dst` are (address, row bytes), `runs` the
    (source row, destination row, count) runs and `rows()` every source and destination row (int64
    tensors, made where needed). Whole rows on both sides: one copy per run; else one per row and piece,
    as one vector sum (`benchmark/bench_shard_writes.py`)."""
    (s_ptr, s_row), (d_ptr, d_row) = src, dst
    if len(pieces) == 1 and pieces[0][:2] == (0, 0) and pieces[0][2] * unit == s_row == d_row:
        return [(s_ptr + s * s_row, d_ptr + d * d_row, n * s_row) for s, d, n in runs]
    s_rows, d_rows = rows()
    s_off = torch.tensor([so * unit for so, _, _ in pieces], dtype=torch.int64)
    d_off = torch.tensor([do * unit for _, do, _ in pieces], dtype=torch.int64)
    s_addr = (s_rows[:, None] * s_row + s_off[None, :] + s_ptr).flatten().tolist()
    d_addr = (d_rows[:, None] * d_row + d_off[None, :] + d_ptr).flatten().tolist()
    return list(zip(s_addr, d_addr, [k * unit for _, _, k in pieces] * len(s_rows), strict=True))


def shard_writes(
    src_rank: int,
    src: list[tuple[PoolLayout, ShardLayout]],
    dst: list[tuple[PoolLayout, ShardLayout]],
    src_tokens: list[int],
    dst_tokens: list[int],
    src_slot: int | None,
    dst_slot: int,
) -> list[tuple[int, list[Descriptor]]]:
    """Prefill rank `src_rank`'s writes of one request: [(decode rank, descriptors)], for the decode ranks
    it writes to. KV buffer i of the source to buffer i of each destination, token rows src_tokens[t] ->
    dst_tokens[t]; state buffer i (conv of each linear layer, then SSM of each) slot row src_slot ->
    dst_slot (`src_slot` None: no state rows, a window of the prompt's positions alone). ValueError where a layout does not fit its pools or no prefill rank holds a decode unit
    (`layout_mismatch` says why first)."""
    for side, ranks in (("prefill", src), ("decode", dst)):
        for pool, shard in ranks:
            check_rows(pool, shard, side)
    # (keyed by the runs alone: the pieces do not depend on the unit's bytes, which a staged chunk scales
    # by its positions: `staged_route.chunk_shards`)
    plan = _plan(tuple(_unitless(s) for _, s in src), tuple(_unitless(s) for _, s in dst))
    mine_pool, mine = src[src_rank]
    runs = token_runs(src_tokens, dst_tokens)
    token_rows = cache(lambda: (torch.tensor(src_tokens), torch.tensor(dst_tokens)))
    slot_rows = cache(lambda: (torch.tensor([src_slot]), torch.tensor([dst_slot])))
    half = len(mine_pool.state_ptrs) // 2
    writes = []
    for d, ((pool, _), axes) in enumerate(zip(dst, plan, strict=True)):
        out: list[Descriptor] = []
        kv = axes["kv"].get(src_rank, [])
        if kv:
            for s_ptr, d_ptr in zip(mine_pool.kv_ptrs, pool.kv_ptrs, strict=True):
                rows = (s_ptr, mine_pool.kv_bytes_per_token), (d_ptr, pool.kv_bytes_per_token)
                out += _row_copies(kv, mine.kv.unit_bytes, *rows, runs, token_rows)
        for i, (s_ptr, d_ptr) in enumerate(zip(mine_pool.state_ptrs, pool.state_ptrs, strict=True)):
            axis = "conv" if i < half else "ssm"
            pieces = axes[axis].get(src_rank, []) if src_slot is not None else []
            if pieces:
                rows = (s_ptr, mine_pool.state_slot_bytes[i]), (d_ptr, pool.state_slot_bytes[i])
                slot_run = [(src_slot, dst_slot, 1)]
                out += _row_copies(pieces, getattr(mine, axis).unit_bytes, *rows, slot_run, slot_rows)
        if out:
            writes.append((d, out))
    return writes
