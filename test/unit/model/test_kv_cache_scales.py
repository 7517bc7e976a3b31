"""`--kv-cache-dtype fp8_e4m3` with the checkpoint's per-layer `k_scale` / `v_scale` (upstream's names):
K and V are stored as x / scale in float8 and read back as stored x scale; without them the scale is
1.0 and one warning names the flag.

The checkpoints are the tiny presets with every full-attention layer's keys and values GROW times larger
and the network unchanged: queries and o_proj are GROW times smaller (Qwen3-Next: its q_norm / k_norm
effective weights, v_proj, o_proj; Nemotron-H: q/k/v/o_proj), as a checkpoint calibrated for scales
may have them. At scale 1.0 the keys and values are far past float8 e4m3's +-448 and saturate; with
scales of GROW they are stored as the presets' own values are. The reference is the same checkpoint with
a float32 KV pool.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.model_executor.loaded_weights import LoadedWeights
from sglang.srt.models.loader import checkpoint_files
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import decode_steps, make_runner, prefill, random_ids
from sglang.test.runner_driver import RunnerDriver

register_cpu_ci(est_time=15, suite="per-commit-cpu")

GROW = 1000.0
# Where each preset's scales sit: beside the attention (Qwen3-Next) and on the projections (Nemotron-H,
# ModelOpt's layout), two of the placements upstream reads.
PRESETS = {
    "tiny-qwen3-next": ("self_attn", "model.layers.{i}.self_attn.{kind}"),
    "tiny-nemotron-h": ("mixer", "backbone.layers.{i}.mixer.{proj}.{kind}"),
}
# (tensor name suffix, factor): Qwen3-Next normalises q and k after their projections, and its norms
# multiply by 1 + weight.
EDITS = {
    "tiny-qwen3-next": {
        "q_norm.weight": 1 / GROW,
        "k_norm.weight": GROW,
        "v_proj.weight": GROW,
        "o_proj.weight": 1 / GROW,
    },
    "tiny-nemotron-h": {
        "q_proj.weight": 1 / GROW,
        "k_proj.weight": GROW,
        "v_proj.weight": GROW,
        "o_proj.weight": 1 / GROW,
    },
}
# Measured on CPU (a 200-token prompt in three chunks and 6 decode steps), mean |logprob - float32 KV|:
# with the scales 8.5e-3 (qwen3-next) and 1.2e-2 (nemotron-h), the presets' own float8 error
# (`test_kv_cache_dtype.py`: <= 1.3e-2); without them 0.15 and 0.46 (17x and 39x). Bounds:
# test_kv_cache_dtype.py's float8 mean bound for the scaled run, and the unscaled run at least 5x worse.
SCALED_MEAN_MAX = 4e-2
# On CUDA (Triton attention; not run on a GPU yet): test_kv_cache_dtype.py's allowance for FLA's prefill.
GPU_EXTRA_MEAN = 5e-3
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, gpu])]
UNSCALED_RATIO_MIN = 5.0


def _grown_checkpoint(preset: str, dst: Path, with_scales: bool) -> str:
    from safetensors.torch import load_file, save_file

    shutil.copytree(resolve_model_path(preset), dst)
    attn, template = PRESETS[preset]
    for path in checkpoint_files(dst):
        weights = load_file(str(path))
        layers = set()
        for name in list(weights):
            factor = next(
                (f for suffix, f in EDITS[preset].items() if name.endswith(f".{attn}.{suffix}")), None
            )
            if factor is None or name.startswith("mtp."):  # (the MTP layer is not served here)
                continue
            w = weights[name].float()
            new = factor * (1.0 + w) - 1.0 if name.endswith("norm.weight") else factor * w
            weights[name] = new.to(weights[name].dtype)
            layers.add(int(name.split(".layers.")[1].split(".")[0]))
        for i in sorted(layers) if with_scales else []:
            for kind, proj in (("k_scale", "k_proj"), ("v_scale", "v_proj")):
                weights[template.format(i=i, kind=kind, proj=proj)] = torch.tensor(GROW, dtype=torch.float32)
        save_file(weights, str(path), metadata={"format": "pt"})
    return str(dst)


def _logprobs(path: str, kv: str, device: str = "cpu") -> torch.Tensor:
    """A 200-token prompt's logprobs (prefilled in three chunks), then 6 greedy decode steps' (the
    decode path: sgl-kernel's C++ op where built)."""
    driver = RunnerDriver(make_runner(path, kv_cache_dtype=kv, dtype="float32", device=device))
    req = driver.new_request()
    lps = prefill(driver, req, random_ids(200, seed=50), cuts=[64, 150])
    return torch.tensor(lps + decode_steps(driver, [req], 6)[0])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", list(PRESETS))
def test_scales_bring_fp8_kv_back_to_the_float32_kv_logprobs(preset, device, tmp_path, caplog):
    if device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton has e4m3fn from compute capability 8.9; the server refuses it below")
    scaled = _grown_checkpoint(preset, tmp_path / "scaled", with_scales=True)
    unscaled = _grown_checkpoint(preset, tmp_path / "unscaled", with_scales=False)
    want = _logprobs(scaled, "auto", device)
    runner = make_runner(scaled, kv_cache_dtype="fp8_e4m3", dtype="float32", device=device)
    radix = [m for m in runner.model.modules() if type(m).__name__ == "RadixAttention"]
    assert radix and all(m.k_scale == m.v_scale == pytest.approx(GROW) for m in radix)

    with caplog.at_level(logging.WARNING, logger="sglang.srt.layers.attention.kv_scales"):
        err_scaled = (_logprobs(scaled, "fp8_e4m3", device) - want).abs().mean().item()
        assert not [r for r in caplog.records if "k_scale" in r.getMessage()]
        err_unscaled = (_logprobs(unscaled, "fp8_e4m3", device) - want).abs().mean().item()
    warnings = [r.getMessage() for r in caplog.records if "k_scale" in r.getMessage()]
    assert len(warnings) == 1 and "--kv-cache-dtype fp8_e4m3" in warnings[0]
    print(f"{preset}: mean error with scales {err_scaled:.2e}, without {err_unscaled:.2e}")
    assert err_scaled < SCALED_MEAN_MAX + (GPU_EXTRA_MEAN if device == "cuda" else 0.0)
    assert err_unscaled > UNSCALED_RATIO_MIN * err_scaled


def test_a_per_channel_scale_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    path = _grown_checkpoint("tiny-qwen3-next", tmp_path / "ckpt", with_scales=True)
    (file,) = checkpoint_files(path)
    weights = load_file(str(file))
    name = next(n for n in weights if n.endswith("k_scale"))
    weights[name] = torch.full((4,), GROW)
    save_file(weights, str(file), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="one k_scale per layer"):
        make_runner(path, kv_cache_dtype="fp8_e4m3", dtype="float32")


def test_a_refused_weight_update_leaves_the_kv_scales_as_they_were():
    """A weight update is all or nothing: a k_scale sent beside a tensor that does not fit was set at once,
    so the refused update still changed it; an accepted one sets it."""
    from sglang.srt.configs.model_config import load_hf_config
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.models.registry import load_model

    path = resolve_model_path("tiny-qwen3-next")
    model = load_model(load_hf_config(path), path, torch.float32, "cpu")
    name, attn = next((n, m) for n, m in model.named_modules() if isinstance(m, RadixAttention))
    owner = name.rpartition(".")[0]
    before = attn.k_scale
    with pytest.raises(ValueError):
        model.load_weights([(owner + ".k_scale", torch.tensor(1000.0)), (owner + ".o_proj.weight", torch.zeros(3, 3))], update=True)  # fmt: skip
    assert attn.k_scale == before
    model.load_weights([(owner + ".k_scale", torch.tensor(1000.0))], update=True)
    assert attn.k_scale == 1000.0


def test_graphs_are_captured_again_when_an_update_changes_a_kv_scale():
    """The float8 KV scales are numbers a captured CUDA graph holds (folded into the softmax scale), not
    parameters whose memory an in-place update writes: an update that changes one captures the graphs
    again; one that changes only parameters does not (checked with a stand-in graph runner on CPU)."""
    from types import SimpleNamespace

    from sglang.srt.layers.radix_attention import RadixAttention

    runner = make_runner("tiny-qwen3-next", kv_cache_dtype="fp8_e4m3")
    recaptured = []
    runner.graph_runner = SimpleNamespace(recapture=lambda: recaptured.append(1))
    name = next(n for n, m in runner.model.named_modules() if isinstance(m, RadixAttention))
    owner = name.rpartition(".")[0]
    weight = dict(runner.model.named_parameters())[owner + ".o_proj.weight"].detach().clone()
    runner.update_weights_from_tensor([(owner + ".o_proj.weight", weight)])
    assert recaptured == []
    attn = runner.model.get_submodule(name)
    assert attn.kv_scales == (1.0, 1.0)  # (the checkpoint has none)
    runner.update_weights_from_tensor([(owner + ".k_scale", torch.tensor(0.5))])
    assert recaptured == [1]
    # Resolved once, at the update: the pair both backends read.
    assert attn.kv_scales == (0.5, 1.0)


def test_an_update_resolves_the_kv_scales_without_cuda_graphs(caplog):
    """Without CUDA graphs (a CPU server, --disable-cuda-graph) an update that sets a k_scale still sets the
    pair both backends read (the resolution was skipped with the recapture when there was no graph
    runner); a model swap resolves them again without a second missing-scale warning (one per start)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    with caplog.at_level(logging.WARNING, logger="sglang.srt.layers.attention.kv_scales"):
        runner = make_runner("tiny-qwen3-next", kv_cache_dtype="fp8_e4m3")
    assert runner.graph_runner is None
    assert len([r for r in caplog.records if "k_scale" in r.getMessage()]) == 1  # at start
    name = next(n for n, m in runner.model.named_modules() if isinstance(m, RadixAttention))
    attn = runner.model.get_submodule(name)
    runner.update_weights_from_tensor([(name.rpartition(".")[0] + ".k_scale", torch.tensor(0.5))])
    assert attn.kv_scales == (0.5, 1.0)
    caplog.clear()
    attn.k_scale = 0.25  # as a swapped-in model with other scales would have them
    with caplog.at_level(logging.WARNING, logger="sglang.srt.layers.attention.kv_scales"):
        runner.swap_model(LoadedWeights(runner.model, runner.draft_model))
    assert attn.kv_scales == (0.25, 1.0)
    assert not [r for r in caplog.records if "k_scale" in r.getMessage()]


def test_the_scales_are_resolved_for_the_pools_dtype():
    """The layers' `kv_scales` are the checkpoint's for a float8 pool (1.0 where it has none) and 1.0 for
    any other pool, which stores values as they are; set once at start, not looked up per forward."""
    from sglang.srt.layers.attention.kv_scales import resolve_kv_scales
    from sglang.srt.layers.radix_attention import RadixAttention

    a, b = RadixAttention(2, 8, 1.0, 1, 0), RadixAttention(2, 8, 1.0, 1, 1)
    a.k_scale, a.v_scale = 2.0, 3.0
    model = torch.nn.ModuleList([a, b])
    assert resolve_kv_scales([model, None], torch.float8_e4m3fn) == [(2.0, 3.0), (1.0, 1.0)]
    assert a.kv_scales == (2.0, 3.0) and b.kv_scales == (1.0, 1.0)
    assert resolve_kv_scales([model], torch.bfloat16) == [(1.0, 1.0), (1.0, 1.0)]
    assert a.kv_scales == (1.0, 1.0)
