"""The shard map against the real model at TP 4 (`test_shard_map_model.py` at TP 2): the tiny presets'
two KV heads and two Mamba2 groups are each replicated on two of the four gloo ranks, and each rank's
rows of the first linear layer's state and the first full-attention layer's K and V must be TP 1's at
the units its ShardLayout names (the Qwen3 GDN presets' two key heads do not split four ways: refused)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.multi_rank import run_ranks
from sglang.test.shard_map_checks import check_ranks, first_layer_rows

register_cpu_ci(est_time=18, suite="per-commit-cpu")

PRESETS = ("tiny-nemotron-h", "tiny-granite-4.0-h", "tiny-falcon-h1", "tiny-bamba", "tiny-lfm2")


@pytest.fixture(scope="module")
def runs(preset_paths) -> tuple[dict, list[dict]]:
    paths = {name: preset_paths[name] for name in PRESETS}
    with ThreadPoolExecutor(1) as pool:
        ranks = pool.submit(run_ranks, first_layer_rows, 4, paths, timeout=300)
        tp1 = first_layer_rows(0, 1, None, paths)
        return tp1, ranks.result()


@pytest.mark.parametrize("name", PRESETS)
def test_each_tp4_ranks_rows_are_tp1s_at_its_layouts_units(name, runs):
    tp1, ranks = runs
    check_ranks(tp1, ranks, name)
    # Ranks 0, 1 hold KV head 0 and ranks 2, 3 head 1 (tp / heads consecutive ranks per head).
    assert [r[name]["layout"]["kv"]["runs"] for r in ranks] == [[[0, 1]]] * 2 + [[[1, 1]]] * 2
