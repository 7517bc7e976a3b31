"""The weights fingerprint does not depend on --tp-size / --ep-size (`weights_fingerprint.py`): for each
preset with TP support (Qwen3-Next, Qwen3.5, Qwen3.5-MoE, Nemotron-H, Granite-4.0-H, Falcon-H1, Bamba,
and Bamba with one Mamba2 group, replicated on both ranks; LFM2, LFM2-MoE, and a block-FP8 checkpoint
with FP8 experts), two gloo ranks at TP 2
(and TP 2 with --ep-size 2 where the model has experts) each compute their share, and the shares' sum
and the meta digest equal TP 1's. One bit flipped in one element of the last rank's shard (stacked
experts where the model has them) changes the total, to TP 1's total with the same element of the full
tensor flipped. TP 4 (KV heads and every preset's Mamba2 groups replicated) runs in nightly-cpu:
`test_weights_fingerprint_tp4_nightly.py`."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.fingerprint_checks import FP8_EXPERTS, Case, check_totals, rank_shares
from sglang.test.multi_rank import run_ranks
from sglang.test.tp_mamba2_checks import one_group_bamba

register_cpu_ci(est_time=10, suite="per-commit-cpu")


def cases(paths: dict[str, str]) -> list[Case]:
    out = []
    for name, eps, env in (
        ("tiny-qwen3-next", (1, 2), {}),
        ("tiny-qwen3.5", (1,), {}),
        ("tiny-qwen3.5-moe", (1, 2), {}),
        ("tiny-nemotron-h", (1, 2), {}),
        ("tiny-granite-4.0-h", (1, 2), {}),
        ("tiny-falcon-h1", (1,), {}),
        ("tiny-bamba", (1,), {}),
        ("tiny-bamba-1-group", (1,), {}),
        ("tiny-lfm2", (1,), {}),
        ("tiny-lfm2-moe", (1, 2), {}),
        # A block-FP8 checkpoint as the CPU serves it (dequantized at load), and one with FP8 experts
        # (float8 weights, their weight_scale_inv split in blocks: whole 128-blocks per rank only at EP 2
        # here, the tiny experts' intermediate size being 32).
        ("tiny-qwen3-next-fp8", (1, 2), {}),
        ("tiny-qwen3.5-moe-fp8", (2,), FP8_EXPERTS),
    ):
        out += [Case(f"{name} ep {ep}", paths[name], ep, env) for ep in eps]
    # With its MTP draft model (NEXTN): the draft layer's tensors count too, sharded alike.
    out.append(Case("tiny-qwen3-next nextn", paths["tiny-qwen3-next"], server_args={"speculative_algorithm": "NEXTN"}))
    return out


@pytest.fixture(scope="module")
def paths(preset_paths, tmp_path_factory) -> dict[str, str]:
    from sglang.srt.configs.presets import resolve_model_path

    out = dict(preset_paths)
    for name in ("tiny-qwen3-next-fp8", "tiny-qwen3.5-moe-fp8"):
        out[name] = resolve_model_path(name)
    out["tiny-bamba-1-group"] = one_group_bamba(preset_paths["tiny-bamba"], tmp_path_factory.mktemp("b") / "c")
    return out


def test_tp2_and_ep2_totals_equal_tp1s(paths):
    every = cases(paths)
    check_totals(every, run_ranks(rank_shares, 2, every))
