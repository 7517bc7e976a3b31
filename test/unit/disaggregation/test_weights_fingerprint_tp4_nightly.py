"""The weights fingerprint at TP 4 (`test_weights_fingerprint_tp.py` runs TP 2): four gloo ranks, where
the tiny presets' KV heads (2) and every Mamba2 preset's groups are replicated over several ranks, each
element counting on the lowest rank holding it; with --ep-size 2 and 4 for the MoE presets (experts
held by 2 or 1 ranks each), and the ModelOpt FP8 checkpoint with FP8 experts (per-tensor scales: at EP 1
and 2 each rank's scale grid is its own, the blocks holding the expert's one scale). Every total and meta
digest equals TP 1's, before and after one element of the last rank's shard is flipped. (Qwen3-Next and
Qwen3.5 refuse TP 4: their 2 linear-attention key heads do not split 4 ways.)"""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.fingerprint_checks import FP8_EXPERTS, Case, check_totals, rank_shares
from sglang.test.multi_rank import run_ranks
from sglang.test.tp_mamba2_checks import one_group_bamba

register_cpu_ci(est_time=20, suite="nightly-cpu")


@pytest.fixture(scope="module")
def paths(preset_paths, tmp_path_factory) -> dict[str, str]:
    from sglang.srt.configs.presets import resolve_model_path

    out = dict(preset_paths)
    out["tiny-nemotron-h-fp8-modelopt"] = resolve_model_path("tiny-nemotron-h-fp8-modelopt")
    out["tiny-bamba-1-group"] = one_group_bamba(preset_paths["tiny-bamba"], tmp_path_factory.mktemp("b") / "c")
    return out


def test_tp4_totals_equal_tp1s(paths):
    every = []
    for name, eps, env in (
        ("tiny-nemotron-h", (1, 2, 4), {}),
        ("tiny-granite-4.0-h", (1, 2, 4), {}),
        ("tiny-falcon-h1", (1,), {}),
        ("tiny-bamba", (1,), {}),
        ("tiny-bamba-1-group", (1,), {}),
        ("tiny-lfm2", (1,), {}),
        ("tiny-lfm2-moe", (1, 2, 4), {}),
        ("tiny-nemotron-h-fp8-modelopt", (1, 2), FP8_EXPERTS),
    ):
        every += [Case(f"{name} ep {ep}", paths[name], ep, env) for ep in eps]
    check_totals(every, run_ranks(rank_shares, 4, every))
