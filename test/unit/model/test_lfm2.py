"""LFM2 (`Lfm2ForCausalLM`) and LFM2-MoE: short-conv layers, whose state is their conv window alone, and attention
with q/k norms. The runner's logprobs equal transformers' (float32, teacher-forced) through chunked
prefills, decodes and batched extends over cached prefixes; the pool's conv rows, snapshots included,
are transformers' conv states; the MLP width is derived as transformers derives it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.models.lfm2 import Lfm2MoeBlock, ffn_dim
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import (
    batched_extends_error,
    chunked_prefill_and_decode_error,
    make_runner,
    max_abs,
    pool_state,
    random_ids,
)
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=4, suite="per-commit-cpu")

PRESET = "tiny-lfm2"
# As test_logprobs_vs_oracle: float32 against float32 differs only in summation order (measured ~6e-6
# in logprob here); a conv with an activation, a dropped bias or a stale window moves logprobs by 0.05+.
TOL = 1e-4


@pytest.mark.parametrize("preset", [PRESET, "tiny-lfm2-moe"])
def test_chunked_prefill_and_decode_match_the_oracle(preset, oracles):
    # Chunks shorter than the conv window (K-1 = 2) too.
    err = chunked_prefill_and_decode_error(
        preset, oracles[preset], prompt_len=150, cuts=[1, 2, 64, 100], decode=16, seed=170
    )
    assert err < TOL


@pytest.mark.parametrize("preset", [PRESET, "tiny-lfm2-moe"])
def test_batched_extends_with_prefixes_match_the_oracle(preset, oracles):
    err = batched_extends_error(preset, oracles[preset], prefixes=[0, 1, 64], extends=[70, 1, 45], seed=180)
    assert err < TOL


def test_lfm2_moe_layers():
    """LFM2-MoE: dense MLPs (their width as given) for the first `num_dense_layers`, then MoEs routed
    by the checkpoint's expert bias; the published per-expert `w1` / `w3` / `w2` tensors load."""
    layers = make_runner("tiny-lfm2-moe").model.model.layers
    assert type(layers[0].mlp) is GatedMLP and layers[0].mlp.gate_proj.out_features == 96
    moe = [layer.mlp for layer in layers[1:]]
    assert all(isinstance(m, Lfm2MoeBlock) for m in moe)
    assert all(m.expert_bias.abs().sum() > 0 and m.experts.w13.shape == (8, 64, 64) for m in moe)


def test_the_pool_holds_the_conv_windows_snapshots_included(oracles):
    """The running slot after a prefill and a snapshot at the kernel chunk inside it are transformers'
    conv states (the last K-1 conv inputs) at those positions."""
    runner = make_runner(PRESET)
    driver = RunnerDriver(runner)
    req = driver.new_request()
    # The default strategy (extra_buffer_lazy) keeps no track slot: the snapshot goes into a slot
    # borrowed from the pool, as the scheduler's tracker does.
    [snap] = driver.alloc_mamba_slots(1)
    prompt = random_ids(100, seed=190)
    driver.extend([Extend(req, prompt, track_seqlen=64, track_slot=snap)])
    oracle = oracles[PRESET]
    for slot, length in ((req.mamba_pool_idx, 100), (snap, 64)):
        got, want = pool_state(runner, slot), oracle.states_after(prompt, length)
        assert sorted(got) == [0, 1, 3]
        for layer, state in got.items():
            # A copy of projected inputs (~1e-7 round-off); another position's window errs by O(1).
            assert max_abs(state.conv, want[layer].conv) < 1e-5 * want[layer].conv.abs().max().item()


def test_mlp_width_is_derived_as_transformers_derives_it():
    cfg = dict(intermediate_size=12288, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0)
    assert ffn_dim(SimpleNamespace(**cfg, block_multiple_of=256)) == 8192
    assert ffn_dim(SimpleNamespace(**cfg, block_multiple_of=1000)) == 9000  # rounded up to the multiple
    assert (
        ffn_dim(SimpleNamespace(**{**cfg, "block_auto_adjust_ff_dim": False}, block_multiple_of=256)) == 12288
    )


def test_layer_kinds_are_read_as_transformers_reads_them():
    from sglang.srt.configs import hybrid_arch_config

    def kinds(**kw):
        cfg = SimpleNamespace(architectures=["Lfm2ForCausalLM"], num_hidden_layers=3, **kw)
        return hybrid_arch_config(cfg).layer_types

    assert kinds(layer_types=["conv", "full_attention", "conv"]) == ["linear_attention", "full_attention"] + [
        "linear_attention"
    ]
    assert kinds(layer_types=None, full_attn_idxs=[2]) == ["linear_attention"] * 2 + ["full_attention"]
    assert kinds(layer_types=None, full_attn_idxs=None) == ["full_attention"] * 3  # transformers' default
    cfg = dict(intermediate_size=12288, block_auto_adjust_ff_dim=True, block_multiple_of=256)
    assert ffn_dim(SimpleNamespace(**cfg, block_ffn_dim_multiplier=None)) == 8192  # no rounding up
