"""Prefill/decode disaggregation under tensor parallelism, without servers (`disaggregation/pd_ranks.py`):

- the per-rank transfer plan: prefill rank i writes exactly its own pools' rows (its KV heads of the
  request's tokens, its recurrent heads' state of the running slot) into decode rank i's pools, through
  decode rank i's session, and nothing into another rank's;
- between servers of other --tp-size sizes each decode rank's heads come from the prefill rank that
  holds them, at their place in its rows (`shard_map`), staged too (`staged_route`); a decode layout
  other than the model's own at its size, or none, is refused in one sentence naming --tp-size, and a
  rank of another layout is refused naming the rank;
- a transfer ends when every rank's write has ended, with the first failing rank's error naming it, the
  bytes of every rank and the longest rank's seconds; rank 0's messages and clock reach every rank;
- staged: each rank's range address in the destination, a chunk announced once every rank wrote it;
- decode ranks release a destination rank 0 could not send together, at the next poll."""

from __future__ import annotations

import ctypes
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape
from sglang.srt.disaggregation.destination import malformed_dst
from sglang.srt.disaggregation.pd_ranks import (
    PdRanks,
    check_targets,
    destination_ranks,
    rank_writes,
)
from sglang.srt.disaggregation.shard_map import ShardLayout
from sglang.srt.disaggregation.transfer import PoolLayout
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

TP = 2
# The model the pools below hold, in TP 1's layout: 2 KV heads of 4 float32; a conv state of q | k | v,
# 4 channels each, of 3 bfloat16 (a window of K - 1 = 3); 2 SSM heads of [4, 4] float32. Each of two
# ranks holds one KV head, its half of q, of k and of v, and one SSM head (`shard_map.ShardLayout`).
KV_UNIT, CONV_UNIT, SSM_UNIT = 16, 6, 64


def shards(rank: int, tp: int) -> dict:
    half = 4 // tp
    conv = [[rank * half, half], [4 + rank * half, half], [8 + rank * half, half]]
    return ShardLayout.from_dict({
        "kv": {"runs": [[rank * 2 // tp, 2 // tp]], "unit_bytes": KV_UNIT},
        "conv": {"runs": conv, "unit_bytes": CONV_UNIT},
        "ssm": {"runs": [[rank * 2 // tp, 2 // tp]], "unit_bytes": SSM_UNIT},
    }).to_dict()  # fmt: skip


def rank_pools(rank: int, fill: bool, tp: int = TP):
    """One rank's pools at `tp`: its KV heads and its part of the recurrent state (all at TP 1)."""
    kv = MHATokenToKVPool(64, 1, torch.float32, head_num=2 // tp, head_dim=4, layer_ids=[0, 3])
    params = Mamba2CacheParams(
        shape=Mamba2StateShape(conv=(12 // tp, 3), temporal=(2 // tp, 4, 4), conv_kernel=4),
        dtype=Mamba2StateDType(conv=torch.bfloat16, temporal=torch.float32),
        layers=(1, 2),
    )
    mp = MambaPool(8, params)
    gen = torch.Generator().manual_seed(100 + rank)
    for buf in kv.k_buffer + kv.v_buffer + [mp.conv_state, mp.ssm_state]:
        buf.copy_(torch.randn(buf.shape, generator=gen).to(buf.dtype) if fill else torch.zeros_like(buf))
    return kv, mp


def layout(pools, rank: int, tp: int = TP) -> PoolLayout:
    return replace(PoolLayout.of(*pools), shards=shards(rank, tp))


def rows(kv, mp, tokens, slot):
    out = [torch.cat([b[t] for t in tokens]) for b in kv.k_buffer + kv.v_buffer]
    return out + [mp.conv_state[:, slot].clone(), mp.ssm_state[:, slot].clone()]


def destination(decode_layouts: list[PoolLayout], dst_tokens: list[int], dst_slot: int, **extra) -> dict:
    targets = [{"session": f"decode-rank-{r}", "layout": lay.to_dict()} for r, lay in enumerate(decode_layouts)]
    return {"notify": "tcp://x:1", "session": "decode-rank-0", "layout": targets[0]["layout"], "kv": dst_tokens,
            "slot": dst_slot, **destination_ranks(targets), **extra}  # fmt: skip


def test_each_prefill_rank_writes_its_shard_into_the_same_decode_rank_only():
    prefill = [rank_pools(r, fill=True) for r in range(TP)]
    decode = [rank_pools(r, fill=False) for r in range(TP)]
    layouts = [layout(p, r) for r, p in enumerate(prefill)]
    src_tokens, dst_tokens, src_slot, dst_slot = [5, 6, 7, 20], [40, 41, 42, 9], 3, 6
    dst = destination([layout(d, r) for r, d in enumerate(decode)], dst_tokens, dst_slot)
    assert malformed_dst(dst, 100) is None and check_targets(layouts, dst) is None
    for r in range(TP):
        [(session, descriptors)] = rank_writes(layouts, dst, r, src_tokens, src_slot)
        assert session == f"decode-rank-{r}"
        before_other = [b.clone() for b in rows(*decode[1 - r], dst_tokens, dst_slot)]
        for src, to, n in descriptors:
            ctypes.memmove(to, src, n)
        got, want = rows(*decode[r], dst_tokens, dst_slot), rows(*prefill[r], src_tokens, src_slot)
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
        for got, want in zip(rows(*decode[1 - r], dst_tokens, dst_slot), before_other, strict=True):
            assert torch.equal(got, want)  # (rank r's write touched no other rank's pools)
    # The two ranks' shards differ, so a swap would have been caught.
    first, second = rows(*decode[0], dst_tokens, dst_slot), rows(*decode[1], dst_tokens, dst_slot)
    assert not torch.equal(first[0], second[0])


def global_rows(pools: list, tokens: list[int], slot: int) -> list[torch.Tensor]:
    """The TP-1 rows of `tokens` and `slot` from every rank's pools (TP 2 ranks: head / half by head)."""
    per_rank = [rows(*p, tokens, slot) for p in pools]
    if len(pools) == 1:
        return per_rank[0]
    t = len(tokens)
    kv = [torch.cat([r[i].view(t, -1, 4) for r in per_rank], dim=1).view(-1, 4) for i in range(4)]
    conv = torch.cat([r[4].view(2, 3, -1, 3) for r in per_rank], dim=2).view(2, -1, 3)  # (q | k | v halves)
    ssm = torch.cat([r[5] for r in per_rank], dim=1)
    return [*kv, conv, ssm]


@pytest.mark.parametrize("window", [512, 3])
@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_between_tp_sizes_every_decode_rank_gets_its_heads_from_the_prefill_rank_holding_them(
    prefill_tp, decode_tp, window, monkeypatch
):
    """Upstream's scatter / gather between TP sizes: each decode rank's KV heads, q / k / v conv channels
    and SSM heads come from the prefill rank holding them, at their place in its rows. The copies are
    built `WINDOW_POSITIONS` positions at a time as they are written (R2: TP 1 -> 16 held ~6 GiB of
    descriptors for a 131k-token prompt); a window of 3 of the 4 positions gives the same rows."""
    import sglang.srt.disaggregation.pd_ranks as pd_ranks

    monkeypatch.setattr(pd_ranks, "WINDOW_POSITIONS", window)
    prefill = [rank_pools(r, fill=True, tp=prefill_tp) for r in range(prefill_tp)]
    decode = [rank_pools(r, fill=False, tp=decode_tp) for r in range(decode_tp)]
    layouts = [layout(p, r, prefill_tp) for r, p in enumerate(prefill)]
    src_tokens, dst_tokens, src_slot, dst_slot = [5, 6, 7, 20], [40, 41, 42, 9], 3, 6
    dst = destination([layout(d, r, decode_tp) for r, d in enumerate(decode)], dst_tokens, dst_slot)
    assert malformed_dst(dst, 100) is None and check_targets(layouts, dst) is None
    sessions = []
    for r in range(prefill_tp):
        for session, descriptors in rank_writes(layouts, dst, r, src_tokens, src_slot):
            sessions.append(session)
            for src, to, n in descriptors:
                ctypes.memmove(to, src, n)
    # (2 -> 1: both prefill ranks write into the one decode rank; 1 -> 2: the one writes into both; per
    # window of positions)
    assert sorted(set(sessions)) == [f"decode-rank-{r}" for r in range(decode_tp)]
    assert len(sessions) == max(prefill_tp, decode_tp) * -(-len(src_tokens) // window)
    got, want = global_rows(decode, dst_tokens, dst_slot), global_rows(prefill, src_tokens, src_slot)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


def test_the_direct_path_between_tp_sizes_says_once_that_staging_is_faster(monkeypatch, caplog):
    """Pools registered as they are take one copy per position between TP sizes (~100x the time
    through Mooncake TCP): the first such transfer of each pair of sizes says so, naming the switch that
    avoids it; the same size says nothing."""
    import sglang.srt.disaggregation.pd_ranks as pd_ranks

    monkeypatch.setattr(pd_ranks, "_warned_sizes", set())
    prefill = [layout(rank_pools(r, fill=False, tp=2), r, 2) for r in range(2)]
    for decode_tp in (2, 1, 1):
        decode = [layout(rank_pools(r, fill=False, tp=decode_tp), r, decode_tp) for r in range(decode_tp)]
        dst = destination(decode, [40, 41], 6)
        for r in range(2):
            list(rank_writes(prefill, dst, r, [5, 6], 3))
    said = [rec.getMessage() for rec in caplog.records if "SGLANG_DISAGGREGATION_STAGING=1" in rec.getMessage()]
    assert len(said) == 1 and "--tp-size 1 and this one of 2" in said[0], said


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2), (2, 2)])
def test_staged_chunks_between_tp_sizes_land_as_the_decode_ranks_own_rows(prefill_tp, decode_tp):
    """The staged path (host staging buffers, in chunks) between servers of any --tp-size: each prefill
    rank packs its rows, writes the parts of every decode rank's block it holds into that rank's range
    (`staged_route.py`), a chunk is unpacked once every prefill rank wrote it, and each decode rank's
    rows are then exactly the prefill ranks' TP-1 rows it holds. Ranges of 420 bytes: 3 or 6 of the 13
    positions a chunk (a position weighs 128 bytes at TP 1, 64 at TP 2), the state in a chunk of its own."""
    import threading

    from sglang.srt.disaggregation.staged_route import staged_route
    from sglang.srt.disaggregation.staging import ChunkLink, StagedRange, Staging
    from sglang.srt.disaggregation.state_packer import StatePacker

    def staging(pools, nbytes):
        kv, mp = pools
        return Staging.create(StatePacker.of(kv, mp, "cpu"), nbytes, nbytes)

    prefill = [rank_pools(r, fill=True, tp=prefill_tp) for r in range(prefill_tp)]
    decode = [rank_pools(r, fill=False, tp=decode_tp) for r in range(decode_tp)]
    layouts = [layout(p, r, prefill_tp) for r, p in enumerate(prefill)]
    src_tokens, dst_tokens, src_slot, dst_slot = list(range(3, 16)), list(range(40, 53)), 3, 6
    req = SimpleNamespace(kv_indices=dst_tokens, origin_input_ids=dst_tokens, rid="r", mamba_pool_idx=dst_slot)
    sending = [staging(p, 1000) for p in prefill]
    receiving = [staging(d, 1000) for d in decode]
    entries = []
    for d in receiving:
        length = min(d.range_bytes(len(dst_tokens)), 420)  # (a TP-1 state is 400 bytes; several chunks)
        entries.append(StagedRange(req, d.ranges.alloc(length), length, prefix=0))
    targets = [{"session": f"decode-rank-{j}", "layout": layout(d, j, decode_tp).to_dict(),
                "staging": receiving[j].address(e.start), "staging_bytes": e.length}
               for j, (d, e) in enumerate(zip(decode, entries, strict=True))]  # fmt: skip
    dst = {"notify": "tcp://x:1", "session": "decode-rank-0", "layout": targets[0]["layout"], "kv": dst_tokens,
           "slot": dst_slot, "staging": targets[0]["staging"], "staging_bytes": entries[0].length,
           **destination_ranks(targets, staged=(0, entries[0].length))}  # fmt: skip
    if decode_tp > 1:  # (each rank's own range: their starts differ here, which a real server's do not)
        for entry, t in zip(dst["ranks"], targets, strict=True):
            entry["staging"] = t["staging"]
    assert malformed_dst(dst, 100) is None and check_targets(layouts, dst, expected) is None

    def unpack_all(chunk):  # (the decode ranks, once every prefill rank wrote the chunk)
        for d, e in zip(receiving, entries, strict=True):
            assert d.receive(e, chunk) is None

    class Lockstep(ChunkLink):
        def wait_ack(self, chunk, timeout):
            announced.append(chunk)
            barrier.wait()

    announced = []
    barrier = threading.Barrier(prefill_tp, action=lambda: unpack_all(announced[-1]))
    results = [None] * prefill_tp

    def send(r):
        route = staged_route(layouts, dst, r, sending[r])
        results[r] = sending[r].send(memmove, route, src_tokens, src_slot, Lockstep(), 10.0)

    threads = [threading.Thread(target=send, args=(r,)) for r in range(prefill_tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert all(r is not None for r in results), results
    last = results[0][1]
    assert all(r[1] == last for r in results) and len(announced) >= 2 * prefill_tp  # (several chunks)
    unpack_all(last)
    assert all(e.complete() for e in entries)
    got, want = global_rows(decode, dst_tokens, dst_slot), global_rows(prefill, src_tokens, src_slot)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))


@pytest.mark.parametrize("prefill_tp, decode_tp", [(2, 1), (1, 2)])
def test_a_staged_chunk_between_tp_sizes_moves_a_heads_kv_in_one_copy_whatever_its_positions(
    prefill_tp, decode_tp
):
    """A packed block's KV is head-major (`StatePacker`), so a prefill rank's part of a decode rank's
    block is one copy per KV buffer: here one head (16 bytes a position) of each of the 4 buffers, for 1,
    6 or 13 positions alike. Token-major blocks made it one copy per buffer and position (24 for 6
    positions), ~100x slower through Mooncake TCP (`benchmark/bench_pd_staging.py`)."""
    from sglang.srt.disaggregation.staged_route import staged_route

    layouts = [layout(rank_pools(r, fill=False, tp=prefill_tp), r, prefill_tp) for r in range(prefill_tp)]
    decode = [layout(rank_pools(r, fill=False, tp=decode_tp), r, decode_tp) for r in range(decode_tp)]
    targets = [{"session": f"decode-rank-{j}", "layout": lay.to_dict(), "staging": (j + 1) << 20,
                "staging_bytes": 4096} for j, lay in enumerate(decode)]  # fmt: skip
    dst = {"notify": "tcp://x:1", "session": "decode-rank-0", "layout": targets[0]["layout"], "kv": [1],
           "slot": 1, "staging": targets[0]["staging"], "staging_bytes": 4096,
           **destination_ranks(targets, staged=(0, 4096))}  # fmt: skip
    if decode_tp > 1:
        for entry, t in zip(dst["ranks"], targets, strict=True):
            entry["staging"] = t["staging"]
    assert check_targets(layouts, dst, expected) is None
    from sglang.srt.disaggregation.shard_map import _plan

    _plan.cache_clear()
    for r in range(prefill_tp):
        route = staged_route(layouts, dst, r, staging=None)  # (the packer is read at the same size only)
        for positions in (1, 6, 13):
            writes = route.writes(0, positions, 0, False)
            assert sorted(s for s, _ in writes) == [t["session"] for t in targets]
            for _, descriptors in writes:
                assert [n for _, _, n in descriptors] == [positions * KV_UNIT] * 4, (r, positions, descriptors)
    # One plan for the pair whatever the chunk's positions (review finding 3: a miss per chunk length).
    assert _plan.cache_info().currsize == 1, _plan.cache_info()


def memmove(session: str, descriptors: list) -> None:
    for src, to, n in descriptors:
        ctypes.memmove(to, src, n)


def test_another_tp_size_is_refused_without_shard_layouts():
    prefill = [rank_pools(r, fill=False) for r in range(TP)]
    layouts = [layout(p, r) for r, p in enumerate(prefill)]
    one = layout(rank_pools(0, fill=False, tp=1), 0, tp=1)
    dst = destination([one], [1], 0)
    assert check_targets(layouts, dst) is None
    problem = check_targets(layouts, destination([replace(one, shards=None)], [1], 0))
    assert "does not say which heads its ranks hold: use the same --tp-size" in problem
    # Another model: the decode rank holds 3 SSM heads where the prefill ranks hold 2 together.
    other = replace(one, shards={**one.shards, "ssm": {"runs": [[0, 3]], "unit_bytes": SSM_UNIT}})
    assert "SSM-state heads" in check_targets(layouts, destination([other], [1], 0))


def expected(tp: int) -> list[ShardLayout]:
    """The test model's rule (`shards`): what its ranks hold at `tp`."""
    if 2 % tp:
        raise ValueError(f"2 KV heads do not split over {tp}")
    return [ShardLayout.from_dict(shards(r, tp)) for r in range(tp)]


def test_a_decode_layout_other_than_the_models_own_at_its_size_is_refused_before_anything_is_built():
    """Review R1 finding 1: decode ranks that each claim every unit (as many TP-1 layouts as ranks, up to
    64) passed, and made each prefill rank build (and hold) that many TP-1 transfers: 12.6 M descriptors,
    1.85 GiB, 3.9 s for one 8,192-token prompt. Each decode rank's layout must be the model's own at the
    decode server's size, and fill that rank's pools."""
    layouts = [layout(rank_pools(r, fill=False), r) for r in range(TP)]
    one = layout(rank_pools(0, fill=False, tp=1), 0, tp=1)
    assert check_targets(layouts, destination([one], [1], 0), expected) is None
    greedy = destination([one, one, one, one], [1], 0)  # (4 decode ranks, each claiming all of the model)
    assert check_targets(layouts, greedy) is None  # (without the model's rule: what R1 found)
    problem = check_targets(layouts, greedy, expected)
    assert problem.startswith("the decode server runs --tp-size 4 and this prefill server --tp-size 2, "
                              "which this model does not split over"), problem  # fmt: skip
    two = [layout(rank_pools(r, fill=False, tp=1), 0, tp=1) for r in range(2)]  # (2 ranks, each all of it)
    problem = check_targets([one], destination(two, [1], 0), expected)
    assert "its ranks say they hold other heads than this model's ranks at that size do" in problem
    # A layout that does not fill its rank's pools: refused in a sentence, not raised while building.
    halves = [layout(rank_pools(r, fill=False), r) for r in range(TP)]
    short = replace(halves[1], state_slot_bytes=halves[1].state_slot_bytes[:-1] + [1])
    problem = check_targets([one], destination([halves[0], short], [1], 0), expected)
    assert problem == "the decode server's state rows and its shard layout differ in size (TP rank 1)", problem


def test_at_another_tp_size_every_decode_rank_is_compared():
    """Review R1 finding 3: only decode rank 0's layout was compared (a float8 KV on rank 1 alone, or an
    MTP layer on rank 1 alone, was served; a KV buffer fewer raised on the transfer thread)."""
    one = [layout(rank_pools(0, fill=False, tp=1), 0, tp=1)]
    halves = [layout(rank_pools(r, fill=False), r) for r in range(TP)]
    fp8 = replace(halves[1], kv_dtype="torch.float8_e4m3fn")
    problem = check_targets(one, destination([halves[0], fp8], [1], 0), expected)
    assert problem.endswith("--kv-cache-dtype) (the decode server's TP rank 1)"), problem
    fewer = replace(halves[1], kv_ptrs=halves[1].kv_ptrs[:-1], kv_nbytes=halves[1].kv_nbytes[:-1])
    problem = check_targets(one, destination([halves[0], fewer], [1], 0), expected)
    assert "the KV layouts differ" in problem and problem.endswith("(the decode server's TP rank 1)"), problem


def test_a_staged_pair_of_another_block_format_is_refused_in_a_sentence():
    """Review of 30940a0, finding 2: a staged block's KV became head-major; a decode server of an older
    build (token-major blocks, its layout without `staged_blocks`) passed every check, and at the same
    --tp-size the whole block was copied as it was: scrambled KV, wrong tokens. Now refused, naming why."""
    from sglang.srt.disaggregation.destination import unfit_dst
    from sglang.srt.disaggregation.state_packer import BLOCK_FORMAT

    prefill = [layout(rank_pools(0, fill=False, tp=1), 0, tp=1)]
    assert prefill[0].staged_blocks == BLOCK_FORMAT
    dst = destination(prefill, [1, 2], 3, staging=4096, staging_bytes=1024)
    assert unfit_dst(prefill, dst, 2, staged=True) is None
    older = {k: v for k, v in dst["layout"].items() if k != "staged_blocks"}
    problem = unfit_dst(prefill, {**dst, "layout": older}, 2, staged=True)
    assert problem == ("the decode server packs staged blocks as an older build did (KV token-major), this "
                       "one as kv head-major: run the same build of the server on both"), problem  # fmt: skip
    assert unfit_dst(prefill, destination(prefill, [1, 2], 3), 2, staged=False) is None  # (direct: no blocks)


def test_another_layout_is_refused_naming_the_rank():
    prefill = [layout(rank_pools(r, fill=False), r) for r in range(TP)]
    one = destination(prefill[:1], [1], 0)
    other = {**prefill[1].to_dict(), "kv_dtype": "torch.bfloat16"}
    targets = [{"session": "a", "layout": prefill[0].to_dict()}, {"session": "b", "layout": other}]
    problem = check_targets(prefill, {**one, **destination_ranks(targets)})
    assert problem.endswith("--kv-cache-dtype) (TP rank 1)"), problem


def test_a_malformed_rank_entry_is_refused():
    layout = PoolLayout([], [], 0, [], [], []).to_dict()
    base = {"notify": "tcp://x:1", "session": "s", "layout": layout, "kv": [1], "slot": 0}
    assert malformed_dst({**base, "ranks": [{"session": "a", "layout": layout}] * 2}, 100) is None
    assert malformed_dst({**base, "ranks": [{"session": 1, "layout": layout}]}, 100) is not None
    bad_layout = [{"session": "a", "layout": {"kv_ptrs": "x"}}]
    assert malformed_dst({**base, "ranks": bad_layout}, 100) is not None
    assert malformed_dst({**base, "ranks": []}, 100) is not None
    assert malformed_dst({**base, "ranks": "ab"}, 100) is not None


def test_a_staged_destination_whose_ranks_lack_their_range_or_whose_lists_differ_is_refused():
    """Review finding 1 (issue 56): each of these passed and then raised while the transfer was built (a
    KeyError on the scheduler's thread: the prefill server died; a ValueError from a strict zip)."""
    layout = PoolLayout.of(*rank_pools(0, False)).to_dict()
    base = {"notify": "tcp://x:1", "session": "s", "layout": layout, "kv": [1], "slot": 1}
    staged = {**base, "staging": 4096, "staging_bytes": 1 << 20}
    entry = {"layout": layout, "staging": 4096, "staging_bytes": 1 << 20}
    good = [{"session": f"s{r}", **entry} for r in range(2)]
    assert malformed_dst({**staged, "ranks": good}, 100) is None
    lacking = [{"session": "s0", "layout": layout}, {"session": "s1", "layout": layout}]
    assert "each rank's staging" in malformed_dst({**staged, "ranks": lacking}, 100)
    empty = [{**good[0], "staging_bytes": 0}, good[1]]
    assert "each rank's staging" in malformed_dst({**staged, "ranks": empty}, 100)
    assert "staging_bytes must be a size above 0" in malformed_dst({**base, "staging": 4096}, 100)
    assert "without one" in malformed_dst({**base, "ranks": good}, 100)
    short = {**layout, "state_ptrs": layout["state_ptrs"][:1]}
    problem = malformed_dst({**base, "layout": short}, 100)
    assert "state_ptrs, state_nbytes and state_slot_bytes differ" in problem
    short_kv = {**layout, "kv_nbytes": []}
    assert "kv_ptrs and kv_nbytes differ" in malformed_dst({**base, "layout": short_kv}, 100)


class _Gathered(PdRanks):
    """Two ranks whose all-gather returns what each gave (as gloo would)."""

    def __init__(self, everyone):
        super().__init__(len(everyone), 0)
        self.everyone = everyone

    def all_gather(self, value):
        return [value, *self.everyone[1:]]


def test_a_transfer_ends_when_every_rank_has_ended_with_the_first_failure():
    rank1 = (None, {"a": (None, 100, 0.5, None), "b": ("Mooncake write failed (code -1)", 0, 0.1, None)})
    ranks = _Gathered([None, rank1])
    first = (["msg"], 12.5)
    mine = {"a": (None, 100, 0.2, None), "b": (None, 80, 0.3, None), "c": (None, 10, 0.1, None)}
    got_first, ended, failing = ranks.exchange(first, mine)
    assert got_first == first
    assert ended == {  # "c": rank 1's write still runs
        "a": (None, 200, 0.5, None),
        "b": ("Mooncake write failed (code -1) (on TP rank 1)", 80, 0.3, None),
    }
    assert failing == {}
    # A failure on rank 1 while rank 0's write runs: reported at once, for rank 0 to stop its write.
    rank1 = (None, {"d": ("Mooncake write failed (code -1)", 0, 0.1, None)})
    _, ended, failing = _Gathered([None, rank1]).exchange(first, {})
    assert ended == {} and failing == {"d": "Mooncake write failed (code -1) (on TP rank 1)"}
    # One rank: its own outcome as it is.
    single = PdRanks()
    assert single.exchange(first, mine) == (first, mine, {})


def test_staged_destinations_name_each_rank_range_and_chunks_wait_for_every_rank():
    targets = [{"session": f"s{r}", "layout": {"r": r}, "staging": 1000 * (r + 1)} for r in range(TP)]
    ranks = destination_ranks(targets, staged=(256, 4096))["ranks"]
    assert [(e["session"], e["staging"], e["staging_bytes"]) for e in ranks] == [
        ("s0", 1256, 4096), ("s1", 2256, 4096)
    ]  # fmt: skip
    assert "staging" not in destination_ranks(targets)["ranks"][0]
    assert destination_ranks(targets[:1], staged=(256, 4096)) == {}  # (one rank: the top-level fields)
    # A chunk is announced once every rank's thread has written it.
    assert _Gathered([None, {"a": 1, "b": 3}]).written_everywhere({"a": 2, "b": 3}) == {"a": 1, "b": 3}


class _Lockstep(PdRanks):
    """Rank `tp_rank` of two whose exchange hands every rank what rank 0 gave (`shared`), as gloo would
    when the two poll in turn (rank 0 first)."""

    def __init__(self, tp_rank: int, shared: dict):
        super().__init__(2, tp_rank)
        self.shared = shared

    def exchange(self, first, ended):
        if self.is_first:
            self.shared["first"] = first
        return self.shared["first"], {}, {}

    def barrier(self):
        pass


def lockstep_decode_queues(send, recv_all=list):
    """Two decode ranks' queues in lockstep (`_Lockstep`), each holding room "a" reserved; rank 0's
    channel sends with `send` and receives `recv_all()`. Returns the queues and what each rank aborted."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import BootstrapInfo
    from sglang.srt.managers.schedule_batch import Req
    from sglang.test.pd_fakes import decode_queue

    shared, queues, aborted = {}, [], [[], []]
    for rank in range(TP):
        sched = SimpleNamespace(processed_batch_id=1, num_batches=1, running=[], max_running_requests=4,
                                abort_with_status=lambda reqs, msg, status, param=None, r=rank:
                                aborted[r].append((reqs[0].bootstrap.room, msg, status)))  # fmt: skip
        q = decode_queue(sched)
        q.ranks = _Lockstep(rank, shared)
        q.rank_targets = [{"session": f"s{r}", "layout": {}, "staging": None} for r in range(TP)]
        q.channel.send = send if rank == 0 else None  # (rank 1 has no channel to use)
        q.channel.recv_all = recv_all
        if rank:
            q.channel = None
        r = Req("rid-a", [5, 6, 7])
        r.bootstrap = BootstrapInfo("127.0.0.1", 8998, "a")
        r.kv_indices, r.mamba_pool_idx = [10, 11, 12], 3
        r.sampling_params.max_new_tokens = 4
        q.reserved.append((r, 1, 0))
        queues.append(q)
    return queues, aborted


def test_decode_ranks_drop_a_destination_rank_0_could_not_send_in_the_same_poll():
    """Only rank 0 sends; when its send fails (the prefill server takes no messages), every rank releases
    the request at the next poll, none before (a rank that released alone would reuse its slots)."""
    queues, aborted = lockstep_decode_queues(lambda url, msg: False)
    for q in queues:
        assert q._send_destinations()
        assert "a" in q.transfers  # (rank 1 cannot know yet: the send was rank 0's)
    assert queues[0].unsent == ["a"] and queues[1].unsent == []
    for q in queues:
        q.poll()
    assert aborted == [[("a", "The prefill server does not take messages.", 503)]] * 2
    assert all(not q.transfers and "a" not in q.dst_sent for q in queues)


def test_decode_ranks_all_fail_a_request_whose_answer_is_malformed():
    """Review finding 1 under TP: rank 0 hands its messages over the exchange and every rank reads the
    malformed answer alike: each fails the request (500) in the same poll, none is left holding it."""
    answer = [{"type": "done", "room": "a", "ok": True, "output_ids": ["not-a-token"]}]
    queues, aborted = lockstep_decode_queues(lambda url, msg: True, lambda: list(answer))
    for q in queues:
        assert q._send_destinations()
    for q in queues:
        q.poll()
    assert [[(room, status) for room, _, status in a] for a in aborted] == [[("a", 500)]] * 2
    assert all("malformed answer" in a[0][1] and not q.transfers for a, q in zip(aborted, queues, strict=True))


class _Rank1Failed(PdRanks):
    """Rank 0 of two whose rank 1 reports, in every poll, that its write of room "a" failed, and that it
    wrote no chunk."""

    def __init__(self):
        super().__init__(2, 0)

    def all_gather(self, value):
        if isinstance(value, dict):  # (written_everywhere)
            return [value, {}]
        return [value, (None, {"a": ("Mooncake write of 3 blocks to s1 failed (code -1).", 0, 0.0, [])})]


def test_a_failure_on_one_rank_stops_the_others_at_once_and_is_the_error_reported():
    """Review finding 4 (issue 56): rank 1's staged write failed while rank 0's thread waited for the
    acknowledgement of a chunk the decode server was never told of (rank 1 had not written it). Rank 0
    waited out its ack timeout (up to 60 s), and the request then failed with rank 0's timeout. Now the
    poll that gathers rank 1's failure stops rank 0's transfer, and the room ends with rank 1's error."""
    from concurrent.futures import ThreadPoolExecutor
    from types import SimpleNamespace

    from sglang.srt.disaggregation.prefill import _Room
    from sglang.srt.disaggregation.staging import ChunkLink
    from sglang.test.pd_fakes import prefill_queue

    aborted, sent = [], []
    q = prefill_queue(SimpleNamespace(abort_with_status=lambda reqs, msg, status: aborted.append((msg, status))))
    q.ranks = _Rank1Failed()
    q.channel = SimpleNamespace(recv_all=list, send=lambda url, msg: sent.append(msg))
    link, executor = ChunkLink(), ThreadPoolExecutor(1)
    try:
        future = executor.submit(link.wait_ack, [0, 10, False], 30.0)  # rank 0's thread, chunk 0 written
        dst = {"notify": "tcp://x:1", "room": "a"}
        q.rooms["a"] = _Room(0.0, req=SimpleNamespace(finished=False), dst=dst, future=future, link=link)
        q.poll()
        assert "a" in q.rooms  # (rank 0's write still ran when gathered)
        with pytest.raises(RuntimeError, match="cancelled"):
            future.result(timeout=2)  # (stopped at once; it waited 30 s before, or for ever while paused)
        q.poll()
    finally:
        link.cancel()
        executor.shutdown()
    root = "Mooncake write of 3 blocks to s1 failed (code -1). (on TP rank 1)"
    assert "a" not in q.rooms and q.stats["failed_transfers"] == 1
    assert aborted == [(f"KV transfer to the decode server failed: {root}", 500)]
    assert [m["error"] for m in sent] == [f"KV transfer failed: {root}"]


def test_disaggregation_across_nodes_is_refused_in_one_sentence():
    """Review finding 9 (issue 56): each rank's transfer engine is named by --host, which on node 1 is not
    node 1's address; multi-node PD was neither refused nor tested."""
    from sglang.srt.entrypoints.process_launcher import ServerStartupError, check_flag_support
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs()
    args.disaggregation_mode, args.nnodes, args.tp_size = "prefill", 2, 2
    with pytest.raises(ServerStartupError) as e:
        check_flag_support(args)
    message = str(e.value)
    assert message.startswith("--disaggregation-mode prefill with --nnodes 2: ")
    assert message.endswith("--nnodes 1.")
    assert ". " not in message
    args.nnodes = 1
    check_flag_support(args)  # (one node, TP 2: served)


def test_a_decode_rank_times_a_new_request_from_the_first_poll_after_it_came():
    """Review finding 5 (issue 56): under TP a request's wait for its prefill server's hello was stamped
    with rank 0's clock as of the last poll (0.0 before the first one, old after a pause): the first
    poll then failed it at once with a 503, its prefill server not yet having answered."""
    from types import SimpleNamespace

    from sglang.srt.disaggregation.auth import PeerVerifier
    from sglang.srt.managers.io_struct import BootstrapInfo
    from sglang.srt.managers.schedule_batch import Req
    from sglang.test.pd_fakes import decode_queue

    aborted = []
    sched = SimpleNamespace(processed_batch_id=1, num_batches=1, running=[], max_running_requests=4,
                            abort_with_status=lambda reqs, msg, status, param=None: aborted.append(status))
    q = decode_queue(sched)
    q.ranks = _Lockstep(0, {})
    q.channel.recv_all = list
    q.peers = PeerVerifier(True, q.channel.send, q.notify_url)  # (the prefill server has not answered)
    r = Req("rid-a", [5, 6, 7])
    r.bootstrap = BootstrapInfo("127.0.0.1", 8998, "a")
    q.add(r)  # (before this queue's first poll)
    q.poll()
    assert aborted == [] and q.prealloc == [r]
    q.now = 0.0  # (as after a long pause: no poll ran meanwhile)
    r2 = Req("rid-b", [5, 6, 7])
    r2.bootstrap = BootstrapInfo("127.0.0.1", 8998, "b")
    q.add(r2)
    q.poll()
    assert aborted == [] and q.prealloc == [r, r2]
    assert q.added_at["b"] >= q.added_at["a"] > q.timeout  # (rank 0's clock at the poll after each came)


def test_both_sides_report_what_a_transfer_weighs_on_every_rank_together():
    """Review finding 9 (issue 56): the decode side's /get_server_info gave rank 0's kv_bytes_per_token and
    state_bytes, the prefill side's every rank's together; now both give every rank's together."""
    from types import SimpleNamespace

    from sglang.test.pd_fakes import decode_queue

    layouts = [PoolLayout.of(*rank_pools(r, False)) for r in range(TP)]
    q = decode_queue(SimpleNamespace())
    q.ranks, q.layout = PdRanks(TP, 0), layouts[0]
    q.rank_targets = [{"session": f"s{r}", "layout": layout.to_dict()} for r, layout in enumerate(layouts)]
    one = layouts[0].sizes()
    assert one["kv_bytes_per_token"] > 0 and one["state_bytes"] > 0
    state = q.state()
    assert state["kv_bytes_per_token"] == TP * one["kv_bytes_per_token"]
    assert state["state_bytes"] == TP * one["state_bytes"]


class _Counting(PdRanks):
    """Rank 0 of two whose collectives are counted (and answered as if rank 1 gave the same)."""

    def __init__(self):
        super().__init__(2, 0)
        self.calls = 0

    def all_gather(self, value):
        self.calls += 1
        return [value, value]


def test_an_idle_pd_queue_under_tp_runs_no_collective_until_the_tick_brings_news():
    """Final review finding: every scheduler step of a PD server at TP 2 paid a pickled all-gather over
    gloo, idle too. Now an idle queue polls with no collective on every rank alike; rank 0's channel
    holding messages reaches every rank on the scheduler's tick (`Tick.disagg`, with rank 0's clock),
    and then the poll exchanges."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.scheduler_io import SchedulerIOMixin
    from sglang.test.pd_fakes import decode_queue, prefill_queue

    prefill = prefill_queue(SimpleNamespace())
    prefill.ranks = _Counting()
    prefill.channel = SimpleNamespace(recv_all=list, pull=SimpleNamespace(poll=lambda timeout: 0))
    decode = decode_queue(SimpleNamespace(processed_batch_id=0, running=[], max_running_requests=4))
    decode.ranks = _Counting()
    decode.channel.recv_all, decode.channel.pull = list, SimpleNamespace(poll=lambda timeout: 0)
    for q in (prefill, decode):
        for _ in range(5):
            assert q.poll() is False
        assert q.ranks.calls == 0
        assert q.has_news() is False
        # Rank 0 finds a message waiting as it makes the tick; every rank applies the tick.
        q.channel.pull = SimpleNamespace(poll=lambda timeout: 1)
        rank0 = SimpleNamespace(disagg=q, grammar_queue=None, running=[], waiting_queue=[], in_flight=[],
                                chunked_req=None, recv_requests=lambda timeout: [], _may_run=lambda: False,
                                _tick_aborts=[], weight_update=SimpleNamespace(pending=None))  # fmt: skip
        tick = SchedulerIOMixin._make_tick(rank0, busy=False)
        assert tick.disagg[0] is True and tick.disagg[1] > 0
        other = SimpleNamespace(disagg=q, grammar_queue=SimpleNamespace(apply=lambda g: None),
                                process_input_requests=lambda msgs: None)  # fmt: skip
        SchedulerIOMixin.apply_tick(other, tick)
        assert (q.news, q.now) == tick.disagg
        q.poll()
        assert q.ranks.calls == 1


def test_an_idle_prefill_queue_under_tp_forgets_ended_rooms_past_the_timeout():
    """Review of the idle skip: rooms that ended without a transfer were forgotten after an exchange
    only, so at TP 2 an idle queue kept them for ever, and a new request reusing such a room's id an
    hour later was aborted with a 503 ("the decode server gave room 7 up"). The idle poll forgets them
    too, by the tick's clock (rank 0's, the same on every rank), with no collective."""
    from types import SimpleNamespace

    from sglang.test.pd_fakes import prefill_queue

    aborted = []
    sched = SimpleNamespace(running=[], abort_with_status=lambda reqs, msg, code: aborted.append((msg, code)))
    q = prefill_queue(sched)
    q.ranks = _Counting()
    q.channel = SimpleNamespace(recv_all=list, pull=SimpleNamespace(poll=lambda timeout: 0))
    q.max_unmatched = 64
    q.now = 1000.0
    q._end("7", q.ranks.clock(q.now), "the decode server gave the request up")
    q._end("8", q.ranks.clock(q.now), "the decode server gave the request up")
    q.news, q.now = False, 1000.0 + q.timeout / 2  # (within the timeout: still answered)
    assert q.poll() is False
    assert set(q.ended) == {"7", "8"}
    q.news, q.now = False, 1000.0 + q.timeout + 1  # (the tick's clock, past the timeout)
    assert q.poll() is False
    assert q.ended == {} and q.ranks.calls == 0
    req = SimpleNamespace(bootstrap=SimpleNamespace(room="7"), rid="r")
    q.on_prefill_done(req)  # (no destination yet: the room waits for one)
    assert aborted == [] and q.rooms["7"].req is req


def test_a_tick_s_aborts_end_a_pd_room_by_the_tick_s_clock():
    """Review of the idle skip: `apply_tick` set the PD queue's clock from `Tick.disagg` after applying
    the tick's deadline aborts and messages, so a room they ended was stamped with the previous
    iteration's clock; after an idle spell the next poll then forgot it at once, and the decode server's
    destination for it, coming later, waited for its timeout instead of being answered."""
    from types import SimpleNamespace

    from sglang.srt.managers.io_struct import BootstrapInfo
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.scheduler_io import SchedulerIOMixin
    from sglang.srt.managers.scheduler_components.tp_broadcast import Tick
    from sglang.test.pd_fakes import prefill_queue

    q = prefill_queue(SimpleNamespace(running=[]))
    q.ranks, q.max_unmatched = _Counting(), 64
    q.channel = SimpleNamespace(recv_all=list, pull=SimpleNamespace(poll=lambda timeout: 0))
    q.news, q.now = False, 5.0  # (the last iteration's tick; then the server idled an hour)
    req = Req("r", [5, 6, 7])
    req.bootstrap = BootstrapInfo("127.0.0.1", 8998, "7")
    released = SimpleNamespace(release_finished=q.on_released, send_finished=lambda reqs: None)
    rank = SimpleNamespace(disagg=q, grammar_queue=SimpleNamespace(apply=lambda g: None),
                           reqs_by_rid={"r": req}, weight_update=SimpleNamespace(pending=None),
                           result_processor=released, process_input_requests=lambda msgs: None)  # fmt: skip
    rank.abort_with_status = lambda reqs, msg, status=None, param=None: SchedulerIOMixin.abort_with_status(
        rank, reqs, msg, status, param
    )
    tick = Tick(deadline_aborts=[(["r"], "the request timed out", 503)], disagg=(False, 3605.0))
    SchedulerIOMixin.apply_tick(rank, tick)
    assert q.ended["7"] == (3605.0, "the request timed out")
    q.poll()  # (idle: the room ended now, not an hour ago, is kept)
    assert "7" in q.ended
