"""Tensor parallelism of the Mamba2 family and LFM2 at TP 4 (nightly-cpu: four gloo ranks on this machine's
cores, ~3 min; by hand `python -m pytest test/unit/distributed/test_tp_mamba2_tp4.py`). Every preset's two
Mamba2 groups are then replicated, each on the two ranks whose heads read it, and each output-norm group
spans those two ranks; the key/value heads (2) are replicated too. The checks of `test_tp_mamba2.py` at
TP 4 (tokens equal TP 1's, logprobs the oracle's; each rank's state its part; all-reduces per step; the
gathered weights); TP 3 refused with a sentence naming --tp-size (the tiny presets' 8 Mamba2 and 4
attention heads do not split three ways); TP 2 x EP 2 on the MoE presets (Nemotron-H, Granite-4.0-H,
LFM2-MoE)."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import max_abs
from sglang.test.multi_rank import run_ranks
from sglang.test.reference import ReferenceModel
from sglang.test.tp_mamba2_checks import (
    MOE_PRESETS,
    PRESETS,
    expected_rank_state,
    refused_tp_size,
    run_preset,
    run_presets,
)

register_cpu_ci(est_time=180, suite="nightly-cpu")

TOL = 1e-4  # as test_tp_mamba2.py: float32, only the order of sums changes
# As test_tp_mamba2.py's, plus one per Mamba2 layer: each output-norm group spans two ranks here.
ALL_REDUCES = {
    "tiny-nemotron-h": 1 + 6 + 3,
    "tiny-granite-4.0-h": 1 + 4 * 2 + 3,
    "tiny-falcon-h1": 1 + 3 * 2 + 3,
    "tiny-bamba": 1 + 4 * 2 + 2,
    "tiny-lfm2": 1 + 4 * 2,
    "tiny-lfm2-moe": 1 + 4 * 2,
}


@pytest.fixture(scope="module")
def runs(preset_paths) -> tuple[dict, list[dict]]:
    paths = {name: preset_paths[name] for name in PRESETS}
    return {name: run_preset(path) for name, path in paths.items()}, run_ranks(run_presets, 4, paths)


@pytest.mark.parametrize("name", PRESETS)
def test_tp4_matches_tp1_and_the_oracle(name, runs, preset_paths):
    tp1, ranks = runs
    oracle = ReferenceModel(preset_paths[name])
    want = [oracle.token_logprobs(seq, start=1).tolist() for seq in tp1[name]["sequences"]]
    for rank, got in enumerate(ranks):
        got = got[name]
        assert got["sequences"] == tp1[name]["sequences"], f"rank {rank} sampled other tokens than TP 1"
        for w, lps in zip(want, got["logprobs"], strict=True):
            assert max_abs(lps, w) < TOL, rank
        assert (got["conv"], got["ssm"]) == expected_rank_state(name, tp1[name]["conv"], tp1[name]["ssm"], 4)
        assert got["kv_heads"] == 1  # 2 key/value heads over 4 ranks: one each, replicated
        assert got["all_reduces_per_decode"] == ALL_REDUCES[name]
        assert got["first_mixer_weights"] == tp1[name]["first_mixer_weights"]


def test_tp2_ep2_on_the_moe_presets(preset_paths):
    """TP 2 x EP 2: each rank holds half the experts whole (the shared experts and everything else split
    as at TP 2); the block's one all-reduce combines the ranks' experts. TP 1's tokens, the oracle's
    logprobs."""
    paths = {name: preset_paths[name] for name in MOE_PRESETS}
    ranks = run_ranks(run_presets, 2, paths, 2)
    for name, path in paths.items():
        want = run_preset(path)
        oracle = ReferenceModel(path)
        scored = [oracle.token_logprobs(seq, start=1).tolist() for seq in want["sequences"]]
        for got in ranks:
            assert got[name]["sequences"] == want["sequences"], name
            for w, lps in zip(scored, got[name]["logprobs"], strict=True):
                assert max_abs(lps, w) < TOL, name


def test_tp3_is_refused(preset_paths):
    errors = run_ranks(refused_tp_size, 3, preset_paths["tiny-nemotron-h"])
    assert all("--tp-size 3 does not divide the model's" in e for e in errors), errors
