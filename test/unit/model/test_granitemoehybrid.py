"""Granite-4.0-H (`GraniteMoeHybridForCausalLM`): the runner's logprobs equal transformers' (float32,
teacher-forced) with rotary attention and MoE (the preset), without positions (Granite-4.0-H's own
`nope`), and with the shared MLP alone (no experts); the scales folded into the weights at load act as
the config's multipliers; configs the runtime cannot serve are refused by name."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from sglang.srt.configs import hybrid_arch_config
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.models.granitemoehybrid import GraniteMoeHybridMoE
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import (
    batched_extends_error,
    chunked_prefill_and_decode_error,
    make_runner,
    variants_with_oracles,
)
from sglang.test.reference import ReferenceModel

register_cpu_ci(est_time=10, suite="per-commit-cpu")

PRESET = "tiny-granite-4.0-h"
# As test_logprobs_vs_oracle: float32 against float32 differs only in summation order (measured ~6e-6
# in logprob here); a dropped multiplier, scale or rotary moves logprobs by 0.05 or more.
TOL = 1e-4
VARIANTS = {
    "rope-moe": {},
    "nope": {"position_embedding_type": "nope"},  # Granite-4.0-H's published setting
    "dense": {"num_local_experts": 0},  # the shared MLP alone (the experts' tensors go unused)
}


@pytest.fixture(scope="module")
def variants(preset_paths, tmp_path_factory) -> dict[str, tuple[str, ReferenceModel]]:
    """variant -> (checkpoint folder, its oracle)."""
    return variants_with_oracles(preset_paths[PRESET], VARIANTS, tmp_path_factory.mktemp)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_and_decode_match_the_oracle(variant, variants):
    # Chunks off the Mamba2 chunk (32) grid, then decode steps.
    err = chunked_prefill_and_decode_error(
        *variants[variant], prompt_len=150, cuts=[7, 32, 100], decode=16, seed=100
    )
    assert err < TOL


@pytest.mark.parametrize("variant", ["rope-moe", "nope"])
def test_batched_extends_with_prefixes_match_the_oracle(variant, variants):
    assert (
        batched_extends_error(*variants[variant], prefixes=[0, 20, 64], extends=[70, 1, 45], seed=110) < TOL
    )


def test_layers_are_built_as_the_config_says(variants):
    moe = make_runner(variants["rope-moe"][0]).model.model.layers
    assert [layer.is_linear for layer in moe] == [True, False, True, True]
    assert all(isinstance(layer.mlp, GraniteMoeHybridMoE) for layer in moe)
    assert moe[1].mixer.rotary_emb is not None and moe[1].mixer.attn.scaling == 0.125
    assert make_runner(variants["nope"][0]).model.model.layers[1].mixer.rotary_emb is None
    assert all(type(layer.mlp) is GatedMLP for layer in make_runner(variants["dense"][0]).model.model.layers)


def _config(**kw) -> SimpleNamespace:
    base = dict(architectures=["GraniteMoeHybridForCausalLM"], layer_types=["mamba", "attention"])
    return SimpleNamespace(**{**base, **kw})


def test_the_checkpoints_layer_names_and_refusals():
    # The hub's config.json says mamba / attention (transformers renames them as it loads).
    arch = hybrid_arch_config(_config(hidden_size=64, mamba_expand=2, mamba_n_heads=8, mamba_d_head="auto"))
    assert arch.layer_types == ["linear_attention", "full_attention"] and arch.mamba_head_dim == 16
    with pytest.raises(ValueError, match="no Mamba layers: it is not a hybrid model"):
        hybrid_arch_config(_config(layer_types=["attention", "attention"]))
    with pytest.raises(ValueError, match=r"time_step_limit with an upper bound \(100.0\)"):
        hybrid_arch_config(_config(time_step_limit=(0.0, 100.0)))
    assert hybrid_arch_config(_config(time_step_limit=(0.001, math.inf))).layer_types[0] == "linear_attention"
