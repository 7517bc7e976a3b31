"""The shard map of PD between servers of different --tp-size (`disaggregation/shard_map.py`), without a
model or transfer engine: for every preset family's config and every pair of TP sizes in {1, 2, 4} the
model splits over, each prefill rank's pools are cut from one random global (TP 1) reference, every
prefill rank's `shard_writes` are applied with memmove, and every decode rank's pools must then hold the
reference's cut for that rank at the destination rows and nothing else; no destination byte is written
twice; at equal TP the copies are `transfer_descriptors`' exactly. The layouts' row sizes are the pools'
(`state_shape`, `kv_heads_per_rank` under a stand-in TP group). That the units are the model's real ones
is `test_shard_map_model.py`'s check."""

from __future__ import annotations

import ctypes
import itertools
import random
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.configs.hybrid_arch import hybrid_arch_config
from sglang.srt.configs.presets import PRESETS
from sglang.srt.disaggregation.shard_map import (
    MAX_RUNS,
    Segments,
    ShardLayout,
    layout_mismatch,
    rank_layout,
    shard_writes,
)
from sglang.srt.disaggregation.transfer import PoolLayout, transfer_descriptors
from sglang.srt.distributed import parallel_state
from sglang.test.ci_register import register_cpu_ci
from sglang.tools.make_tiny_model import tiny_config

register_cpu_ci(est_time=6, suite="per-commit-cpu")

FAMILIES = sorted(set(PRESETS.values()))
SIZES = (1, 2, 4)
POISON = 0xAB  # a decode byte nobody wrote keeps it
SRC_ROWS, DST_ROWS, SRC_SLOTS, DST_SLOTS = 48, 64, 4, 6
# Unit sizes as a bfloat16 KV / conv state and a float32 SSM state give them.
UNIT_DTYPES = {"kv": 2, "conv": 2, "ssm": 4}


def arch_of(family: str):
    return hybrid_arch_config(tiny_config(family))


def layouts(arch, tp: int) -> list[ShardLayout] | None:
    """Every rank's layout at `tp`, or None where the model does not split over it."""
    shape = arch.state_shape  # (TP 1's: this process has no group)
    units = {
        "kv": arch.head_dim * UNIT_DTYPES["kv"],
        "conv": shape.conv[1] * UNIT_DTYPES["conv"],
        "ssm": shape.temporal[1] * shape.temporal[2] * UNIT_DTYPES["ssm"],
    }
    try:
        return [rank_layout(arch, tp, r, units["kv"], units["conv"], units["ssm"]) for r in range(tp)]
    except ValueError:
        return None


def columns(seg: Segments) -> torch.Tensor:
    """The byte columns of the global row that a rank's row holds, in its order."""
    u = seg.unit_bytes
    return torch.cat([torch.arange(a * u, (a + n) * u) for a, n in seg.runs])


class Pools:
    """One rank's pools as byte tensors (`kv` buffers of rows x row bytes, then conv and SSM buffers of
    slots x row bytes), cut from the global `ref` buffers by the rank's layout, and its PoolLayout."""

    def __init__(self, ref: list[torch.Tensor], kinds: list[str], shard: ShardLayout):
        self.bufs = [
            r.index_select(1, columns(getattr(shard, k))).contiguous()
            for r, k in zip(ref, kinds, strict=True)
        ]
        kv = [b for b, k in zip(self.bufs, kinds, strict=True) if k == "kv"]
        state = [b for b, k in zip(self.bufs, kinds, strict=True) if k != "kv"]
        self.layout = PoolLayout(
            kv_ptrs=[b.data_ptr() for b in kv],
            kv_nbytes=[b.nbytes for b in kv],
            kv_bytes_per_token=kv[0].shape[1],
            state_ptrs=[b.data_ptr() for b in state],
            state_nbytes=[b.nbytes for b in state],
            state_slot_bytes=[b.shape[1] for b in state],
        )


def kinds_of(arch) -> list[str]:
    """The axis of each buffer: K and V of each full-attention layer, conv of each linear layer, then SSM."""
    linear = len(arch.linear_layer_ids)
    return ["kv"] * (2 * len(arch.full_attention_layer_ids)) + ["conv"] * linear + ["ssm"] * linear


def token_slots(rng: random.Random, n: int, rows: int) -> list[int]:
    """`n` distinct token slots in [1, rows): a few runs of consecutive slots with gaps between."""
    out: list[int] = []
    free = list(range(1, rows))
    while len(out) < n:
        start = rng.choice([s for s in free if s not in out])
        for s in range(start, min(start + rng.randint(1, 6), rows)):
            if len(out) < n and s not in out:
                out.append(s)
    return out


def global_size(shards: list[ShardLayout], axis: str) -> int:
    return max(a + n for s in shards for a, n in getattr(s, axis).runs)


def move(arch, a: int, b: int, seed: int) -> None:
    """Prefill at TP `a` -> decode at TP `b`: see the module docstring."""
    src_shards, dst_shards = layouts(arch, a), layouts(arch, b)
    assert layout_mismatch(src_shards, dst_shards) is None
    kinds = kinds_of(arch)
    gen = torch.Generator().manual_seed(seed)
    widths = {k: global_size(src_shards, k) * getattr(src_shards[0], k).unit_bytes for k in set(kinds)}
    ref = [
        torch.randint(
            0, 256, (SRC_ROWS if k == "kv" else SRC_SLOTS, widths[k]), generator=gen, dtype=torch.uint8
        )
        for k in kinds
    ]
    rng = random.Random(seed)
    n = rng.randint(1, 20)
    src_tokens, dst_tokens = token_slots(rng, n, SRC_ROWS), token_slots(rng, n, DST_ROWS)
    src_slot, dst_slot = rng.randrange(1, SRC_SLOTS), rng.randrange(1, DST_SLOTS)
    want = []
    for r, k in zip(ref, kinds, strict=True):
        w = torch.full((DST_ROWS if k == "kv" else DST_SLOTS, r.shape[1]), POISON, dtype=torch.uint8)
        if k == "kv":
            w[dst_tokens] = r[src_tokens]
        else:
            w[dst_slot] = r[src_slot]
        want.append(w)
    poisoned = [torch.full_like(w, POISON) for w in want]
    src = [Pools(ref, kinds, s) for s in src_shards]
    dst = [Pools(poisoned, kinds, s) for s in dst_shards]
    pairs = (
        [(p.layout, s) for p, s in zip(src, src_shards, strict=True)],
        [(p.layout, s) for p, s in zip(dst, dst_shards, strict=True)],
    )
    written: list[tuple[int, int]] = []
    for p in range(a):
        writes = shard_writes(p, *pairs, src_tokens, dst_tokens, src_slot, dst_slot)
        if a == b:  # equal TP: today's copies, rank i to rank i
            want_desc = transfer_descriptors(
                src[p].layout, dst[p].layout, src_tokens, dst_tokens, src_slot, dst_slot
            )
            assert writes == [(p, want_desc)]
        for d, descriptors in writes:
            assert 0 <= d < b
            for s_addr, d_addr, nbytes in descriptors:
                ctypes.memmove(d_addr, s_addr, nbytes)
                written.append((d_addr, nbytes))
    written.sort()
    for (x, size), (y, _) in zip(written, written[1:], strict=False):
        assert x + size <= y, "a destination byte is written twice"
    for d, (pools, shard) in enumerate(zip(dst, dst_shards, strict=True)):
        for i, (got, w, k) in enumerate(zip(pools.bufs, want, kinds, strict=True)):
            assert torch.equal(got, w.index_select(1, columns(getattr(shard, k)))), (a, b, d, i, k)
    # Every decode row of the request written whole, once (with the check above: no byte twice).
    assert sum(n for _, n in written) == sum(
        (n if k == "kv" else 1) * getattr(s, k).row_bytes for s in dst_shards for k in kinds
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tp_pair_moves_each_decode_ranks_units_from_the_reference(family):
    arch = arch_of(family)
    allowed = [tp for tp in SIZES if layouts(arch, tp) is not None]
    assert 1 in allowed and 2 in allowed
    for (a, b), seed in zip(itertools.product(allowed, allowed), itertools.count()):
        move(arch, a, b, seed)


@pytest.mark.parametrize("family", FAMILIES)
def test_layouts_fill_the_rows_the_pools_are_built_with(family, monkeypatch):
    """Per TP size and rank, the layout's units are as many as the pools' rows hold at that TP
    (`state_shape` and `kv_heads_per_rank` under a stand-in TP group), and the ranks' units together
    are TP 1's, each once or on every rank alike (replicated)."""
    arch = arch_of(family)
    whole = layouts(arch, 1)[0]
    for tp in SIZES:
        shards = layouts(arch, tp)
        if shards is None:
            continue
        for r, shard in enumerate(shards):
            monkeypatch.setattr(parallel_state, "_TP", SimpleNamespace(world_size=tp, rank_in_group=r))
            shape = arch.state_shape
            assert shard.conv.units == shape.conv[0]
            assert shard.ssm.units == shape.temporal[0]
            assert shard.kv.units == arch.kv_heads_per_rank
        monkeypatch.setattr(parallel_state, "_TP", None)
        for axis in ("kv", "conv", "ssm"):
            held = [u for s in shards for a, n in getattr(s, axis).runs for u in range(a, a + n)]
            total = getattr(whole, axis).units
            assert set(held) == set(range(total))
            for shard in shards:
                assert (
                    len(columns(Segments(getattr(shard, axis).runs, 1)).unique())
                    == getattr(shard, axis).units
                )


def test_tiny_mamba2_groups_and_kv_heads_replicate_at_tp4():
    """Nemotron-H's 2 groups and 2 KV heads at TP 4: ranks 0, 1 hold group / head 0, ranks 2, 3 the other;
    x and the SSM heads split. (The tiny preset: 8 heads of 16 channels, groups of state 16.)"""
    shards = layouts(arch_of("nemotron_h"), 4)
    x, gn = 8 * 16, 2 * 16
    assert [s.kv.runs for s in shards] == [((0, 1),), ((0, 1),), ((1, 1),), ((1, 1),)]
    assert shards[1].conv.runs == ((32, 32), (x, 16), (x + gn, 16))
    assert shards[2].conv.runs == ((64, 32), (x + 16, 16), (x + gn + 16, 16))
    assert [s.ssm.runs for s in shards] == [((2 * r, 2),) for r in range(4)]


def test_gdn_conv_splits_q_k_and_v_apart():
    """Qwen3-Next at TP 2: rank 1 holds the second half of q, of k and of v (2 key heads of 16, 4 value
    heads of 16), and its 2 value heads' SSM state."""
    shard = layouts(arch_of("qwen3_next"), 2)[1]
    assert shard.conv.runs == ((16, 16), (48, 16), (96, 32))
    assert shard.ssm.runs == ((2, 2),)
    assert layouts(arch_of("qwen3_next"), 4) is None  # 2 key heads: the layer refuses TP 4


def test_mismatch_names_another_model_or_dtype():
    qwen, nemotron = layouts(arch_of("qwen3_next"), 2), layouts(arch_of("nemotron_h"), 1)
    assert layout_mismatch(qwen, layouts(arch_of("qwen3_next"), 1)) is None
    problem = layout_mismatch(qwen, nemotron)
    assert problem is not None and "another" in problem
    # The same model with a float32 SSM state on one side and a bfloat16 one on the other.
    half = [ShardLayout(s.kv, s.conv, Segments(s.ssm.runs, s.ssm.unit_bytes // 2)) for s in qwen]
    assert "SSM-state heads weighs" in layout_mismatch(qwen, half)
    # Qwen3.5 has Qwen3-Next's layout: the same units (the weights fingerprint tells them apart).
    assert layout_mismatch(qwen, layouts(arch_of("qwen3_5"), 2)) is None
    assert layout_mismatch([], qwen) is not None


def test_from_dict_round_trips_and_refuses_malformed_layouts():
    shard = layouts(arch_of("granitemoehybrid"), 4)[3]
    assert ShardLayout.from_dict(shard.to_dict()) == shard
    good = shard.to_dict()
    bad = [
        None,
        [],
        {"kv": good["kv"], "conv": good["conv"]},
        {**good, "extra": 1},
        {**good, "kv": {"runs": [[0, 1]]}},
        {**good, "kv": {"runs": [[0, 1]], "unit_bytes": -2}},
        {**good, "kv": {"runs": [[0, 1]], "unit_bytes": 0}},
        {**good, "kv": {"runs": [[0, 1]], "unit_bytes": True}},
        {**good, "kv": {"runs": [[0, 1.0]], "unit_bytes": 32}},
        {**good, "kv": {"runs": [[0, 1, 2]], "unit_bytes": 32}},
        {**good, "kv": {"runs": [[0, 2**41]], "unit_bytes": 32}},
        {**good, "kv": {"runs": "0,1", "unit_bytes": 32}},
        {**good, "kv": {"runs": [[0, 2], [1, 1]], "unit_bytes": 32}},  # unit 1 twice
        {**good, "kv": {"runs": [[2 * i, 1] for i in range(MAX_RUNS + 1)], "unit_bytes": 32}},
    ]
    for d in bad:
        with pytest.raises(ValueError):
            ShardLayout.from_dict(d)


def test_a_layout_that_does_not_fill_its_pools_is_refused():
    arch = arch_of("bamba")
    shards = layouts(arch, 2)
    kinds = kinds_of(arch)
    ref = [torch.zeros(SRC_ROWS if k == "kv" else SRC_SLOTS, 1 << 14, dtype=torch.uint8) for k in kinds]
    pools = [Pools(ref, kinds, s) for s in shards]
    short = ShardLayout(
        shards[1].kv, Segments(shards[1].conv.runs[:1], shards[1].conv.unit_bytes), shards[1].ssm
    )
    src = [(p.layout, s) for p, s in zip(pools, shards, strict=True)]
    with pytest.raises(ValueError, match="state rows"):
        shard_writes(0, src, [src[0], (pools[1].layout, short)], [1], [1], 1, 1)
