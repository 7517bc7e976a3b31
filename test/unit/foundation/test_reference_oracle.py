"""The oracle is self-consistent: its incremental path equals its full forward, and its states,
read out in pool layout and injected into a fresh cache, reproduce the continuation."""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

PRESETS = ["tiny-qwen3-next", "tiny-nemotron-h"]
# float32 round-off of the chunked kernels (~5e-7 relative) amplified through the tiny networks stays
# below this; the presets were conditioned for it (see make_tiny_model.WEIGHT_SCALES).
TOL = 1e-5


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def _token_lp(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("name", PRESETS)
def test_incremental_matches_full_forward(name, oracles):
    ref = oracles[name]
    ids = _ids(240, seed=1)
    full = ref.token_logprobs(ids)
    # chunks of 7, 57, 36 and 1-token decode steps, then a 64-aligned chunk and the tail
    boundaries = [7, 64, 100, 101, 102, 103, 128, 192]
    inc = _token_lp(ref.incremental_logits(ids, boundaries), ids)
    assert (inc - full).abs().max().item() < TOL
    assert torch.equal(full, _token_lp(ref.logits(ids), ids))


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("p", [7, 64, 100])
def test_injected_states_reproduce_the_continuation(name, p, oracles):
    ref = oracles[name]
    ids = _ids(180, seed=2)
    full = ref.token_logprobs(ids, start=p + 1)
    states = ref.states_after(ids, p)
    assert set(states) == set(ref.arch.linear_layer_ids)
    cache = ref.cache_with_states(states, kv_source=ref.cache_after(ids, p))
    cont = _token_lp(ref.extend(cache, ids[p:], p), ids[p:])
    assert (cont - full).abs().max().item() < TOL

    # Negative control: the same continuation without the recurrent state is far off.
    zero = {i: type(s)(torch.zeros_like(s.conv), torch.zeros_like(s.ssm)) for i, s in states.items()}
    cache = ref.cache_with_states(zero, kv_source=ref.cache_after(ids, p))
    wrong = _token_lp(ref.extend(cache, ids[p:], p), ids[p:])
    assert (wrong - full).abs().max().item() > 0.5


@pytest.mark.parametrize("name", PRESETS)
def test_states_change_along_the_sequence(name, oracles):
    ref = oracles[name]
    ids = _ids(120, seed=3)
    a, b = ref.states_after(ids, 60), ref.states_after(ids, 120)
    layer = ref.arch.linear_layer_ids[0]
    assert not torch.allclose(a[layer].ssm, b[layer].ssm)
    # The conv state of a 2-token prefix is the two inputs right-aligned after a zero column.
    short = ref.states_after(ids, 2)[layer].conv
    assert torch.all(short[:, 0] == 0) and short[:, 1:].abs().sum() > 0


def test_greedy_matches_full_forward_argmax(oracles):
    ref = oracles["tiny-qwen3-next"]
    prompt = _ids(20, seed=4)
    out = ref.greedy(prompt, 8)
    logits = ref.logits(prompt + out)
    assert out == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    # A kept continuation: the same again, and a caller writing into its list changes no later one.
    out.append(-1)
    assert ref.greedy(prompt, 8) == out[:-1] and ref.greedy(prompt, 3) == out[:3]


def test_token_logprobs_kept_by_sequence_equal_a_fresh_forward(oracles):
    """token_logprobs keeps each sequence's answer (the suite scores the same outputs under many
    configurations): any start of a kept sequence equals the full forward's, bit for bit, and a caller
    writing into an answer changes no later one."""
    ref = oracles["tiny-qwen3-next"]
    ids = _ids(40, seed=5)
    fresh = ref.logprobs(ids)
    for start in (1, 17, 39, 40):
        want = fresh[start - 1 : -1].gather(1, torch.tensor(ids[start:])[:, None])[:, 0]
        assert torch.equal(ref.token_logprobs(ids, start), want), start
    ref.token_logprobs(ids, 1).fill_(0.0)
    assert torch.equal(ref.token_logprobs(ids, 17), fresh[16:-1].gather(1, torch.tensor(ids[17:])[:, None])[:, 0])
    other = ids[:-1] + [ids[-1] + 1]  # another last token: another sequence, another answer
    assert not torch.equal(ref.token_logprobs(other, 39), ref.token_logprobs(ids, 39))


# Kernel packages transformers swaps in for its torch functions when they import (its
# `use_kernel_func_from_hub_with_fallback`): (package, submodule, functions). On the GPU machine
# flash-linear-attention is installed, and its Triton kernels fail on the oracle's CPU tensors.
FAKE_KERNEL_PACKAGES = [
    ("fla", "ops.gated_delta_rule", ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]),
    ("causal_conv1d", "", ["causal_conv1d_fn", "causal_conv1d_update"]),
]
_SCRIPT = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from sglang.srt.configs.presets import resolve_model_path
from sglang.test.reference import ReferenceModel
name, ids = sys.argv[1], json.loads(sys.argv[2])
raw = AutoModelForCausalLM.from_pretrained(resolve_model_path(name), dtype=torch.float32)
try:
    raw(torch.tensor([ids]))
    fake_ran = False
except RuntimeError as e:
    fake_ran = "fake kernel package" in str(e)
print(json.dumps({"fake_ran": fake_ran, "lp": ReferenceModel(name).token_logprobs(ids).tolist()}))
"""


def test_the_oracle_runs_transformers_torch_code_beside_installed_kernel_packages(tmp_path, oracles):
    """With kernel packages importable (fakes that raise here), the oracle still computes with
    transformers' torch functions, and gets what it gets without them."""
    import json
    import os
    import subprocess
    import sys

    for package, sub, names in FAKE_KERNEL_PACKAGES:
        parts = [package, *sub.split(".")] if sub else [package]
        for depth in range(1, len(parts) + 1):
            d = tmp_path.joinpath(*parts[:depth])
            d.mkdir(exist_ok=True)
            (d / "__init__.py").touch()
        body = "".join(
            f"def {n}(*a, **k):\n    raise RuntimeError('the fake kernel package ran')\n" for n in names
        )
        tmp_path.joinpath(*parts, "__init__.py").write_text(body)
    ids = _ids(80, seed=7)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, "tiny-qwen3-next", json.dumps(ids)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["fake_ran"], "transformers did not pick up the fake kernel package: the test proves nothing"
    # Same torch code on the same machine; 1e-6 allows another summation order across processes.
    want = oracles["tiny-qwen3-next"].token_logprobs(ids)
    assert (torch.tensor(got["lp"]) - want).abs().max().item() < 1e-6


@pytest.mark.parametrize("name", PRESETS)
def test_the_oracle_is_exact_after_a_meta_device_audit(name):
    """An oracle built after one of our models was constructed on the meta device inside a dispatch mode
    (the meta-device audits do that) keeps exact buffers: transformers had left its rotary frequencies
    uninitialised there (ReferenceModel refills them). Its only buffers outside the checkpoint are the
    rotary ones, so refilling them covers them all."""
    from sglang.srt.models.registry import get_model_class
    from sglang.srt.server_args import ServerArgs
    from sglang.test.device_audit import DeviceAudit
    from sglang.test.reference import ReferenceModel

    hf_config = ServerArgs(model_path=name).model_config.hf_config
    with DeviceAudit(), torch.device("meta"):
        get_model_class(hf_config)(hf_config)
    ref = ReferenceModel(name)
    persistent = set(ref.model.state_dict())
    outside = {n for n, _ in ref.model.named_buffers() if n not in persistent}
    assert outside <= {"model.rotary_emb.inv_freq", "model.rotary_emb.original_inv_freq"}, outside
    for module in ref.model.modules():
        if hasattr(module, "original_inv_freq"):
            params = module.config.rope_parameters
            dim = int(module.config.head_dim * params.get("partial_rotary_factor", 1.0))
            want = 1.0 / params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
            torch.testing.assert_close(module.inv_freq, want, rtol=1e-6, atol=0)
            assert torch.equal(module.inv_freq, module.original_inv_freq)


def test_an_oracle_whose_gated_norm_ignores_the_groups_is_refused():
    """transformers 5.17 (the GPU machine's) normalises Granite-4.0-H's and Bamba's gated RMSNorm over the
    whole inner width; the model normalises each of `mamba_n_groups` groups (5.24 does). Its oracle then
    differed from the engine by 0.37 in logprob on tiny-granite-4.0-h (H200, 2026-11-28; the same on CPU
    with 5.17 installed): such norms are found, and only where there are several groups."""
    from types import SimpleNamespace

    from torch import nn

    from sglang.test.reference import ungrouped_gated_norms

    class OldRMSNormGated(nn.Module):  # 5.17's form: no group size
        pass

    class NewRMSNormGated(nn.Module):  # 5.24's form
        group_size = 64

    def model(norm: type, groups: int) -> nn.Module:
        m = nn.Module()
        m.mixer = nn.Module()
        m.mixer.norm = norm()
        m.config = SimpleNamespace(mamba_n_groups=groups)
        return m

    assert ungrouped_gated_norms(model(OldRMSNormGated, 2)) == ["mixer.norm"]
    assert ungrouped_gated_norms(model(NewRMSNormGated, 2)) == []
    assert ungrouped_gated_norms(model(OldRMSNormGated, 1)) == []
