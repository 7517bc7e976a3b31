"""The weights fingerprint under tensor / expert parallelism (`disaggregation/weights_fingerprint.py`), run
on each rank by `sglang.test.multi_rank.run_ranks` (importable by name, as spawn needs); `rank_shares(0,
1, None, cases)` is TP 1, in process. Each case loads a checkpoint at the rank's TP / EP sizes and gives
this rank's meta digest, share and held sum, then both again after one bit of one element is flipped on
the last rank (the other ranks' unchanged): where that element sits in the checkpoint's full tensor, so
that TP 1 flips the same one; and at TP > 1 after one bit of a replicated tensor's copy is flipped on the
last rank too (review R1 finding 2: a copy one rank alone got wrong)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from sglang.srt import distributed as ps


@dataclass(frozen=True)
class Case:
    name: str  # (a label)
    path: str
    ep: int = 1
    env: dict[str, str] = field(default_factory=dict)  # set while the model loads
    # Set: the model and its draft model as a ModelRunner with these server args builds them (NEXTN).
    server_args: dict[str, Any] | None = None


def load(case: Case) -> tuple[torch.nn.Module, torch.nn.Module | None]:
    """(the model, its draft model or None)."""
    from sglang.srt.configs.model_config import load_hf_config
    from sglang.srt.models.registry import load_model

    os.environ.update(case.env)
    try:
        if case.server_args is not None:
            from sglang.test.model_checks import make_runner

            runner = make_runner(case.path, dtype="float32", **case.server_args)
            assert runner.draft_model is not None or "speculative_algorithm" not in case.server_args
            return runner.model, runner.draft_model
        return load_model(load_hf_config(case.path), case.path, torch.float32, "cpu"), None
    finally:
        for key in case.env:
            os.environ.pop(key, None)


def flipped_element(model: torch.nn.Module, tp_rank: int, tp_size: int) -> tuple[str, list[int]]:
    """A floating-point parameter sharded over the TP group (the last of those of the most dimensions and
    shards: stacked experts where the model has them; any at TP 1) and the index, in the checkpoint's full
    tensor, of its local element (0, ..., 0) on this rank."""
    from sglang.srt.layers.linear import weight_shards

    found = None
    for name, p in model.state_dict(keep_vars=True).items():
        shards = weight_shards(p)
        if p.dtype.is_floating_point and p.dim() >= 2 and (shards or tp_size == 1):
            if found is None or (p.dim(), len(shards)) >= (found[1].dim(), len(weight_shards(found[1]))):
                found = (name, p)
    assert found is not None, "no sharded floating-point parameter"
    name, p = found
    index = [0] * p.dim()
    for s in weight_shards(p):
        index[s.dim] = int(s.positions(s.part_of_rank[tp_rank])[0])
    return name, index


def replicated(model: torch.nn.Module) -> str:
    """A floating-point tensor every TP rank holds whole (no shards; a norm where there is one)."""
    from sglang.srt.layers.linear import weight_shards

    names = [n for n, t in model.state_dict(keep_vars=True).items()
             if t.dtype.is_floating_point and t.numel() and not weight_shards(t)]  # fmt: skip
    assert names, "no replicated floating-point tensor"
    return next((n for n in names if "norm" in n), names[0])


def flip(t: torch.Tensor, index: list[int]) -> None:
    """Flip the lowest bit of one element of `t` (a parameter: in place, as a weight update writes)."""
    with torch.no_grad():
        element = t.data[tuple(index)].reshape(1)
        bits = element.view({2: torch.int16, 4: torch.int32, 1: torch.uint8, 8: torch.int64}[t.element_size()])
        bits ^= 1
        t.data[tuple(index)] = element[0]


def one_case(case: Case, tp_rank: int, tp_size: int, flip_at: tuple[str, list[int]] | None) -> dict[str, Any]:
    from sglang.srt.disaggregation.weights_fingerprint import weights_share

    if tp_size > 1:
        ps.initialize_model_parallel(tp_size, case.ep)
    model, draft = load(case)
    digest, share, held = weights_share(model, draft)
    name, global_index = flipped_element(model, tp_rank, tp_size)
    if flip_at is not None:  # (TP 1: the element the last rank of another run flipped)
        name, global_index = flip_at
    if flip_at is not None or tp_rank == tp_size - 1:
        local = [0] * len(global_index) if flip_at is None else global_index
        flip(model.state_dict(keep_vars=True)[name], local)
    _, flipped_share, flipped_held = weights_share(model, draft)
    replica = replica_share = replica_held = None
    if tp_size > 1:  # (a replicated tensor's copy on the last rank: counted on rank 0 only)
        replica = replicated(model)
        if tp_rank == tp_size - 1:
            t = model.state_dict(keep_vars=True)[replica]
            flip(t, [0] * t.dim())
        _, replica_share, replica_held = weights_share(model, draft)
    return {
        "digest": digest,
        "share": share,
        "held": held,
        "flipped_share": flipped_share,
        "flipped_held": flipped_held,
        "replica": replica,
        "replica_share": replica_share,
        "replica_held": replica_held,
        "flipped": (name, global_index),
        "dtypes": sorted({str(t.dtype) for t in model.state_dict().values()}),
    }


def rank_shares(
    rank: int, world_size: int, init_method: str | None, cases: list[Case], flips: list | None = None
) -> list[dict[str, Any]]:
    """Each case's `one_case` on this rank; `flips` (TP 1 only): per case, the element to flip."""
    if world_size > 1:
        ps.init_distributed_environment("gloo", world_size, rank, init_method)
    try:
        return [one_case(c, rank, world_size, flips[i] if flips else None) for i, c in enumerate(cases)]
    finally:
        if world_size > 1:
            ps.destroy_model_parallel()


MASK = (1 << 64) - 1
FP8_EXPERTS = {"SGLANG_FP8_EXPERTS": "fp8"}  # (the CPU dequantizes FP8 at load unless told otherwise)


def check_totals(cases: list[Case], ranks: list[list[dict[str, Any]]]) -> None:
    """Asserts that every rank's meta digest and the sum of the ranks' shares (`ranks`: each rank's
    `rank_shares`) equal TP 1's, computed here; and, with one element of the last rank's shard flipped,
    that the total changes to TP 1's with the same element of the full tensor flipped. Then, with one
    bit of the last rank's copy of a replicated tensor flipped as well (`check_replica`), that the pair
    at the same sizes is refused naming that rank, and that one at TP 1 is not (the documented limit)."""
    flips = [r["flipped"] for r in ranks[-1]]
    tp1 = rank_shares(0, 1, None, cases, flips)
    for i, case in enumerate(cases):
        assert {r[i]["digest"] for r in ranks} == {tp1[i]["digest"]}, case.name
        total = sum(r[i]["share"] for r in ranks) & MASK
        assert total == tp1[i]["share"], case.name
        assert all(r[i]["share"] for r in ranks), case.name  # (each rank counts its own shard)
        flipped = sum(r[i]["flipped_share"] for r in ranks) & MASK
        assert flipped == tp1[i]["flipped_share"] != total, (case.name, flips[i])
        if case.env == FP8_EXPERTS:
            assert "torch.float8_e4m3fn" in tp1[i]["dtypes"], case.name
        check_replica(case, [r[i] for r in ranks], tp1[i])


def check_replica(case: Case, ranks: list[dict[str, Any]], tp1: dict[str, Any]) -> None:
    """One case's ranks (`one_case` at TP > 1) and TP 1's: rank 0 counts all it holds, and after the last
    rank's copy of a replicated tensor changed, the total is unchanged (counted on rank 0) while that
    rank's held sum differs: `weights_mismatch` refuses the pair at the same --tp-size and --ep-size
    naming that rank, and accepts it against TP 1 or another --ep-size (only the totals compare)."""
    from dataclasses import replace

    from sglang.srt.disaggregation.transfer import PoolLayout
    from sglang.srt.disaggregation.weights_fingerprint import weights_mismatch, weights_total

    last = len(ranks) - 1
    assert ranks[0]["held"] == ranks[0]["share"] and tp1["held"] == tp1["share"], case.name
    assert ranks[last]["held"] != ranks[last]["share"], case.name  # (it holds copies: the replicated tensor)
    bare = PoolLayout([], [], 0, [], [], [], ep_size=case.ep)

    def layouts(rows: list[dict[str, Any]], state: str, ep: int = case.ep) -> list[PoolLayout]:
        return [replace(bare, weights_digest=r["digest"], weights_share=r[f"{state}_share"],
                        weights_held=r[f"{state}_held"], ep_size=ep) for r in rows]  # fmt: skip

    good, bad = layouts(ranks, "flipped"), layouts(ranks, "replica")
    assert [r["replica_share"] for r in ranks] == [r["flipped_share"] for r in ranks], case.name
    assert weights_total(good) == weights_total(bad), case.name
    assert weights_mismatch(good, layouts(ranks, "flipped")) is None, case.name
    for a, b in ((good, bad), (bad, good)):
        message = weights_mismatch(a, b)
        assert message is not None and message.endswith(f"(TP rank {last})"), (case.name, message)
    assert weights_mismatch(layouts([tp1], "flipped", 1), bad) is None, case.name
    assert weights_mismatch(layouts(ranks, "flipped", case.ep + 1), bad) is None, case.name
