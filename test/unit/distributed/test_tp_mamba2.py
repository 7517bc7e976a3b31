"""Tensor parallelism of the Mamba2 family and LFM2 (issue 54): at TP 2 (two gloo ranks, one spawn for every
preset) each of tiny-nemotron-h, tiny-granite-4.0-h, tiny-falcon-h1, tiny-bamba, tiny-lfm2 and
tiny-lfm2-moe, plus Bamba with one Mamba2 group (replicated on both ranks, its norm group spanning them),
serves a batched extend, an extend over a prefix and greedy decode steps: both ranks sample TP 1's tokens,
their logprobs match the transformers oracle's, and each rank's state pool holds its half of the heads
(and of the groups, where they split). TP 4 (the groups of every preset replicated) runs in nightly-cpu:
`test_tp_mamba2_tp4.py`."""

from __future__ import annotations

import dataclasses
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang.srt.layers.attention.mamba.mamba2_shards import Mamba2Shards
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import max_abs
from sglang.test.multi_rank import run_ranks
from sglang.test.reference import ReferenceModel
from sglang.test.tp_mamba2_checks import (
    PRESETS,
    UNREDUCED,
    expected_rank_state,
    one_group_bamba,
    run_preset,
    run_presets,
    unreduced_row_parallel_inputs,
)

register_cpu_ci(est_time=25, suite="per-commit-cpu")

# float32 on both sides: TP changes only the order of sums (each rank's partial out_proj / o_proj / MLP
# products added by the all-reduce; the split norm's sum of squares), ~1e-6 relative. Measured at most
# 6.7e-6 in logprob against the oracle at TP 2 (TP 1: 7.6e-6; TP 2 against TP 1: 5.7e-6). A wrong slice of
# a piece (x for B, a group's B for another's) or a missed all-reduce moves logprobs by 0.1 or more.
TOL = 1e-4
ONE_GROUP = "tiny-bamba-1-group"


@pytest.fixture(scope="module")
def paths(preset_paths, tmp_path_factory) -> dict[str, str]:
    out = {name: preset_paths[name] for name in PRESETS}
    out[ONE_GROUP] = one_group_bamba(preset_paths["tiny-bamba"], tmp_path_factory.mktemp("bamba") / "ckpt")
    return out


@pytest.fixture(scope="module")
def runs(paths) -> tuple[dict, dict, list[dict]]:
    """(TP 1's results, the oracle's logprobs of TP 1's sequences, each TP 2 rank's results), per preset.
    TP 1 and the oracle run here while the ranks run (their start is mostly imports)."""
    with ThreadPoolExecutor(1) as pool:
        ranks = pool.submit(run_ranks, run_presets, 2, paths)
        tp1 = {name: run_preset(path) for name, path in paths.items()}
        oracle = {}
        for name, path in paths.items():
            ref = ReferenceModel(path)
            oracle[name] = [ref.token_logprobs(seq, start=1).tolist() for seq in tp1[name]["sequences"]]
        return tp1, oracle, ranks.result()


@pytest.mark.parametrize("name", [*PRESETS, ONE_GROUP])
def test_tp2_matches_tp1_and_the_oracle(name, runs):
    tp1, oracle, ranks = runs
    for rank, got in enumerate([tp1, *ranks]):
        got = got[name]
        assert got["sequences"] == tp1[name]["sequences"], f"rank {rank} sampled other tokens than TP 1"
        for want, lps in zip(oracle[name], got["logprobs"], strict=True):
            err = max_abs(lps, want)
            assert err < TOL, (rank, err)


@pytest.mark.parametrize("name", [*PRESETS, ONE_GROUP])
def test_each_rank_holds_its_part_of_the_state(name, runs):
    """Heads halve; conv rows are [x | B | C], x halved, B and C halved where the two groups split and whole
    (the one group) where it is replicated; the KV pool holds one of the two key/value heads."""
    tp1, _, ranks = runs
    want = expected_rank_state(name, tp1[name]["conv"], tp1[name]["ssm"], 2)
    for got in ranks:
        assert (got[name]["conv"], got[name]["ssm"]) == want
        assert got[name]["kv_heads"] == tp1[name]["kv_heads"] // 2


# All-reduces per decode step at TP 2: the embedding's, one per block (a mixer's out_proj / o_proj, an
# MLP's down_proj, a MoE's routed and shared experts together), Falcon-H1's two mixers of a layer sharing
# one; with one Bamba group over both ranks each Mamba2 layer's norm adds one (2 of its 4 layers).
ALL_REDUCES = {
    "tiny-nemotron-h": 1 + 6,
    "tiny-granite-4.0-h": 1 + 4 * 2,
    "tiny-falcon-h1": 1 + 3 * 2,
    "tiny-bamba": 1 + 4 * 2,
    "tiny-lfm2": 1 + 4 * 2,
    "tiny-lfm2-moe": 1 + 4 * 2,
    ONE_GROUP: 1 + 4 * 2 + 2,
}


@pytest.mark.parametrize("name", [*PRESETS, ONE_GROUP])
def test_each_block_all_reduces_once(name, runs):
    for got in runs[2]:
        assert got[name]["all_reduces_per_decode"] == ALL_REDUCES[name]


@pytest.mark.parametrize("name", [*PRESETS, ONE_GROUP])
def test_get_weights_by_name_gathers_the_whole_tensors(name, runs):
    """A Mamba2 mixer's (or LFM2 short conv's) parameters, each rank's rows of every piece gathered back
    into the checkpoint's layout (replicated groups written once), equal TP 1's."""
    tp1, _, ranks = runs
    want = tp1[name]["first_mixer_weights"]
    assert want and all(got[name]["first_mixer_weights"] == want for got in ranks)


def test_an_unreduced_row_parallel_linear_adds_its_bias_once(runs):
    """A MoE block sums its shared expert's unreduced `down_proj` with the routed experts' part in one
    all-reduce: the bias must come from one rank only (every rank added it before: twice at TP 2)."""
    weight, bias, x = unreduced_row_parallel_inputs()
    for got in runs[2]:
        torch.testing.assert_close(torch.tensor(got[UNREDUCED]), x @ weight.t() + bias)


def test_replicated_groups_go_with_the_heads_that_read_them():
    """8 heads, 2 groups of 16 at TP 4: ranks 0-1 hold group 0, ranks 2-3 group 1 (each rank's 2 heads read
    the group it holds); the input projection's rows are z, x, B, C, dt, each piece split on its own."""
    layout = [Mamba2Shards(8, 16, 2, 16, 4, r) for r in range(4)]
    assert [s.first_group for s in layout] == [0, 0, 1, 1] and all(s.local_groups == 1 for s in layout)
    assert layout[3].in_proj_spans() == [(96, 32), (224, 32), (272, 16), (304, 16), (326, 2)]
    assert layout[3].conv_spans() == [(96, 32), (144, 16), (176, 16)]
    split = Mamba2Shards(8, 16, 2, 16, 2, 1)  # TP 2: one group each
    assert split.in_proj_spans() == [(64, 64), (192, 64), (272, 16), (304, 16), (324, 4)]


@pytest.mark.parametrize(
    ("heads", "groups", "tp", "refusal"),
    [(8, 2, 3, "--tp-size 3 does not divide the model's 8 Mamba2 heads."), (6, 3, 2, "--tp-size 2 neither")],
)
def test_a_tp_size_the_heads_or_groups_do_not_split_under_is_refused(heads, groups, tp, refusal):
    with pytest.raises(ValueError, match=re.escape(refusal)):
        Mamba2Shards(heads, 16, groups, 16, tp, 0).check()


def test_fp8_scale_blocks_follow_the_rows_or_are_refused():
    """An FP8 in_proj's 128x128 scales split with its rows (`fp8.shard_fp8_like` gives them the rule in
    blocks): Nemotron-H 8B's layout at TP 2 puts each rank's z, x, B, C on whole blocks but its 64 dt
    rows not, which is refused with --tp-size named; with 256 heads the dt rows are whole blocks too."""
    nano = Mamba2Shards(128, 64, 8, 128, 2, 0).dim_shard("in_proj_spans")
    with pytest.raises(ValueError, match="--tp-size 2"):
        nano.in_blocks(128).positions(1)
    wide = Mamba2Shards(256, 64, 8, 128, 2, 1).dim_shard("in_proj_spans")
    blocks = wide.in_blocks(128).positions(1)
    rows = wide.positions(1)
    assert torch.equal(blocks, rows[::128] // 128) and blocks.numel() * 128 == rows.numel()


def test_fp8_scale_blocks_are_the_configs_not_inferred():
    """200 rows, ranks holding 100 each, 128-row blocks (2 scale rows): the block size was inferred as
    rows / scale rows = 100, which made each rank's 100 rows one whole 'block' and gave rank 1 scale row
    1, though its rows 100-127 lie in block 0. With the config's block the split is refused."""
    rule = dataclasses.replace(
        Mamba2Shards(8, 16, 2, 16, 2, 0).dim_shard("conv_spans"),
        pieces=(200,),
        spans_of_part=(((0, 100),), ((100, 100),)),
    )
    scales = dataclasses.replace(rule.in_blocks(128), pieces=(2,))  # ceil(200 / 128) scale rows
    with pytest.raises(ValueError, match="whole 128-row FP8 scale blocks at --tp-size 2"):
        scales.positions(1)
    assert rule.in_blocks(50).positions(1).tolist() == [2, 3]  # a block that fits: rows 100-199
