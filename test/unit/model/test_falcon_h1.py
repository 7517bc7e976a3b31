"""Falcon-H1 (`FalconH1ForCausalLM`): Mamba2 and attention side by side in every layer. The runner's
logprobs equal transformers' (float32, teacher-forced) with each of the Mamba2 output norms Falcon-H1
configs choose (norm then gate, the preset; gate then norm; no norm, the gate alone); the muP multipliers
folded into the weights at load act as the config's; every layer has a KV slot and a state slot."""

from __future__ import annotations

import pytest

from sglang.srt.layers.layernorm import GroupedGatedRMSNorm
from sglang.srt.layers.mamba2_mixer import SiluGate
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import (
    batched_extends_error,
    chunked_prefill_and_decode_error,
    make_runner,
    pool_state,
    prefill,
    random_ids,
    state_errors,
    variants_with_oracles,
)
from sglang.test.reference import ReferenceModel
from sglang.test.runner_driver import RunnerDriver

register_cpu_ci(est_time=8, suite="per-commit-cpu")

PRESET = "tiny-falcon-h1"
# As test_logprobs_vs_oracle: float32 against float32 differs only in summation order (measured ~9e-6
# in logprob here); a dropped multiplier or a wrong norm moves logprobs by 0.05 or more.
TOL = 1e-4
VARIANTS = {
    "norm-then-gate": {},
    "gate-then-norm": {"mamba_norm_before_gate": False},
    "gate-only": {"mamba_rms_norm": False},
}


@pytest.fixture(scope="module")
def variants(preset_paths, tmp_path_factory) -> dict[str, tuple[str, ReferenceModel]]:
    """variant -> (checkpoint folder, its oracle)."""
    return variants_with_oracles(preset_paths[PRESET], VARIANTS, tmp_path_factory.mktemp)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_chunked_prefill_and_decode_match_the_oracle(variant, variants):
    err = chunked_prefill_and_decode_error(
        *variants[variant], prompt_len=150, cuts=[7, 32, 100], decode=16, seed=120
    )
    assert err < TOL


def test_batched_extends_with_prefixes_match_the_oracle(variants):
    err = batched_extends_error(
        *variants["norm-then-gate"], prefixes=[0, 20, 64], extends=[70, 1, 45], seed=130
    )
    assert err < TOL


def test_every_layer_has_both_pools(variants):
    runner = make_runner(variants["norm-then-gate"][0])
    layers = runner.model.model.layers
    assert [layer.self_attn.attn.layer_id for layer in layers] == [0, 1, 2]
    assert [layer.mamba.layer_id for layer in layers] == [3, 4, 5]
    assert sorted(runner.mamba_pool.mamba_map) == [3, 4, 5]
    norm = layers[0].mamba.norm
    assert isinstance(norm, GroupedGatedRMSNorm) and not norm.gate_first and norm.group_size == 64
    assert isinstance(make_runner(variants["gate-only"][0]).model.model.layers[0].mamba.norm, SiluGate)


def test_the_state_slot_holds_each_mixers_state(variants):
    """The pool's rows for mixer ids 3..5 are transformers' states of layers 0..2 (the snapshots the
    prefix cache keeps)."""
    path, oracle = variants["norm-then-gate"]
    runner = make_runner(path)
    driver = RunnerDriver(runner)
    req = driver.new_request()
    prompt = random_ids(90, seed=140)
    prefill(driver, req, prompt, cuts=[40])
    got = pool_state(runner, req.mamba_pool_idx)
    assert sorted(got) == [3, 4, 5]
    conv_err, ssm_err = state_errors(got, oracle.states_after(prompt, len(prompt)))
    # As test_state_snapshots: the chunked scan reorders the SSM sum (~1e-6 of its scale); the conv
    # state is a copy of projected inputs.
    assert conv_err < 1e-5 and ssm_err < 1e-5, (conv_err, ssm_err)
