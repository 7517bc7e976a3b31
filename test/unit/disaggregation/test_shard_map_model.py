"""The shard map against the real model (`disaggregation/shard_map.py`): the same prompt prefilled at TP 1
(in this process) and at TP 2 (two gloo ranks) on each family's tiny preset, and on Bamba with one Mamba2
group (replicated on both ranks). Each rank's pool rows must be TP 1's rows at the units its ShardLayout
names: the first linear layer's conv and SSM state and the first full-attention layer's K and V. So a
layout that names other channels, heads or groups than the model's layers really hold fails here (the
pure test, `test_shard_map.py`, takes the layouts as given). TP 4, where the KV heads and every preset's
groups are replicated: `test_shard_map_model_tp4.py`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.multi_rank import run_ranks
from sglang.test.shard_map_checks import check_ranks, first_layer_rows
from sglang.test.tp_mamba2_checks import one_group_bamba

register_cpu_ci(est_time=13, suite="per-commit-cpu")

PRESETS = (
    "tiny-qwen3-next",
    "tiny-qwen3.5",
    "tiny-nemotron-h",
    "tiny-granite-4.0-h",
    "tiny-falcon-h1",
    "tiny-bamba",
    "tiny-lfm2",
)
ONE_GROUP = "tiny-bamba-1-group"


@pytest.fixture(scope="module")
def runs(preset_paths, tmp_path_factory) -> tuple[dict, list[dict]]:
    paths = {name: preset_paths[name] for name in PRESETS}
    paths[ONE_GROUP] = one_group_bamba(preset_paths["tiny-bamba"], tmp_path_factory.mktemp("bamba") / "ckpt")
    with ThreadPoolExecutor(1) as pool:
        ranks = pool.submit(run_ranks, first_layer_rows, 2, paths, timeout=240)
        tp1 = first_layer_rows(0, 1, None, paths)
        return tp1, ranks.result()


@pytest.mark.parametrize("name", [*PRESETS, ONE_GROUP])
def test_each_tp2_ranks_rows_are_tp1s_at_its_layouts_units(name, runs):
    tp1, ranks = runs
    check_ranks(tp1, ranks, name)


def test_one_group_is_held_by_both_ranks(runs):
    """The replicated case the layouts must get right: Bamba's one group's B and C (conv channels
    [128, 160) after x's 128) on both ranks, x's halves apart."""
    _, ranks = runs
    held = [{u for a, n in r[ONE_GROUP]["layout"]["conv"]["runs"] for u in range(a, a + n)} for r in ranks]
    assert held[0] & held[1] == set(range(128, 160))
    assert held[0] | held[1] == set(range(160))
