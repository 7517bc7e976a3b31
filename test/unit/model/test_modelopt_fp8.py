"""NVIDIA ModelOpt FP8 checkpoints (issue 53: the Nemotron FP8 releases): the config read from config.json
or hf_quant_config.json and other ModelOpt algorithms refused, `--quantization modelopt` accepted on such
a checkpoint and refused on another (and `--quantization fp8` on it), non-FP8 KV cache algorithms refused
in both config layouts, the preset written in ModelOpt's converted config.json form, served on CPU as its
dequantized weights with its KV cache scales, and in CUDA's layout (built on the CPU) holding the
checkpoint's FP8 bytes with each per-tensor scale in every block of its grid; a module is FP8 exactly
where its checkpoint tensors are, through each model's renames and splits. The logprobs against the
transformers oracle: test_fp8_checkpoints (its parametrization); through the FP8 experts' torch twin:
test_fp8_experts."""

from __future__ import annotations

import json
import shutil
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from torch import nn

from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.quantization import Fp8ConfigError, checkpoint_quant_config
from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, Fp8BlockLinear, Fp8Layout, dequantize_block_fp8
from sglang.srt.layers.quantization.modelopt import HF_QUANT_CONFIG
from sglang.srt.models.registry import build_meta_model, fp8_dense_modules, load_model
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fp8_partial import keep_dense
from sglang.test.reference import dequantized_checkpoint

register_cpu_ci(est_time=7, suite="per-commit-cpu")

PRESET = "tiny-nemotron-h-fp8-modelopt"
# config.json's form, as ModelOpt's exporter converts it (modelopt.torch.export.convert_hf_config, FP8 with
# an FP8 KV cache): compressed-tensors style groups, kv_cache_scheme, the names and patterns kept in `ignore`.
_FP8 = {"dynamic": False, "num_bits": 8, "type": "float"}
RELEASE_CONFIG = {
    "config_groups": {"group_0": {"input_activations": _FP8, "weights": _FP8, "targets": ["Linear"]}},
    "ignore": ["lm_head", "*mixer.conv1d*", "backbone.layers.3.mixer*"],
    "kv_cache_scheme": _FP8,
    "producer": {"name": "modelopt", "version": "0.37.0"},
    "quant_algo": "FP8",
    "quant_method": "modelopt",
}
# hf_quant_config.json's `quantization`, as `hf_quant_config` reads it (ModelOpt's older layout).
LEGACY_CONFIG = {
    "quant_method": "modelopt",
    "quant_algo": "FP8",
    "kv_cache_quant_algo": "FP8",
    "exclude_modules": ["lm_head"],
}

def _checkpoint(path: str) -> dict[str, torch.Tensor]:
    with safe_open(str(Path(path) / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open is not a mapping


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def test_the_config_is_read_and_other_modelopt_algorithms_are_refused():
    cfg = checkpoint_quant_config(RELEASE_CONFIG)
    assert cfg.method == "modelopt" and cfg.scale_suffix == "_scale"
    assert cfg.ignored_layers == tuple(RELEASE_CONFIG["ignore"])
    legacy = checkpoint_quant_config({**LEGACY_CONFIG, "quant_algo": "fp8"})  # (algo in lower case too)
    assert legacy.method == "modelopt" and legacy.ignored_layers == ("lm_head",)
    refusals = {
        "NVFP4": "ModelOpt's NVFP4 algorithm",
        "FP8_PER_CHANNEL_PER_TOKEN": "ModelOpt's FP8_PER_CHANNEL_PER_TOKEN algorithm",
        "MIXED_PRECISION": "ModelOpt's MIXED_PRECISION algorithm",
    }
    for algo, words in refusals.items():
        with pytest.raises(Fp8ConfigError, match=words):
            checkpoint_quant_config({**RELEASE_CONFIG, "quant_algo": algo})
    with pytest.raises(Fp8ConfigError, match="ModelOpt's NVFP4 KV cache"):
        checkpoint_quant_config({**LEGACY_CONFIG, "kv_cache_quant_algo": "NVFP4"})
    # config.json's kv_cache_scheme: the converter's FP8 dict, or the bare algorithm (older converters
    # wrote "FP8" so too); any other algorithm or scheme is refused naming it (its scales are not FP8's).
    for fp8 in ({"dynamic": False, "num_bits": 8, "type": "float"}, "FP8", None):
        assert checkpoint_quant_config({**RELEASE_CONFIG, "kv_cache_scheme": fp8}).method == "modelopt"
    for scheme, named in (("NVFP4", "NVFP4"), ("INT8", "INT8"), ({"num_bits": 8, "type": "int"}, "INT8"),
                          ({"dynamic": False, "num_bits": 4, "type": "float"}, "FLOAT4")):  # fmt: skip
        with pytest.raises(Fp8ConfigError, match=f"ModelOpt's {named} KV cache"):
            checkpoint_quant_config({**RELEASE_CONFIG, "kv_cache_scheme": scheme})
    # The older converter's config.json: quant_library instead of quant_method, the KV cache's bare "FP8".
    older = {k: v for k, v in RELEASE_CONFIG.items() if k != "quant_method"}
    older = {**older, "quant_library": "modelopt", "kv_cache_scheme": "FP8"}
    assert checkpoint_quant_config(older).method == "modelopt"
    # One module given as a string is that name, not its characters.
    assert checkpoint_quant_config({**RELEASE_CONFIG, "ignore": "lm_head"}).ignored_layers == ("lm_head",)
    # The per-tensor scale becomes the weight's block grid; a per-channel one is not this format.
    grid = cfg.scale_grid(torch.zeros(300, 64, dtype=FP8_DTYPE), torch.tensor(0.5))
    assert grid.shape == (3, 1) and (grid == 0.5).all()
    with pytest.raises(ValueError, match="one scale per tensor"):
        cfg.scale_grid(torch.zeros(300, 64, dtype=FP8_DTYPE), torch.ones(300, 1))


def test_the_modelopt_flag_takes_modelopt_checkpoints_only(tmp_path):
    path = resolve_model_path(PRESET)
    for flag in ("modelopt", "modelopt_fp8"):
        assert ServerArgs(model_path=path, quantization=flag).quantization == flag
        for other, what in (
            ("tiny-nemotron-h", "unquantized"),
            ("tiny-nemotron-h-fp8", "quantized with 'fp8'"),
        ):
            with pytest.raises(ServerArgsError, match=f"cannot be served: --quantization {flag} serves checkpoints "
                               f"NVIDIA ModelOpt quantized to FP8 and this one is {what} "):  # fmt: skip
                ServerArgs(model_path=other, quantization=flag)
    # --quantization fp8 (quantize at load) names another format than the checkpoint's: refused, as upstream.
    refusal = (
        "cannot be served: --quantization fp8 quantizes an unquantized checkpoint block-wise at load and "
        "this one is quantized with NVIDIA ModelOpt's FP8"
    )
    with pytest.raises(ServerArgsError, match=refusal):
        ServerArgs(model_path=path, quantization="fp8")
    # A ModelOpt NVFP4 checkpoint stops the start in one sentence naming the algorithm.
    cfg = json.loads((Path(path) / "config.json").read_text())
    cfg["quantization_config"]["quant_algo"] = "NVFP4"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ServerArgsError, match="cannot be served: its weights are quantized with NVIDIA ModelOpt's "
                       "NVFP4 algorithm; this server serves ModelOpt's FP8"):  # fmt: skip
        ServerArgs(model_path=str(tmp_path))


def test_the_preset_is_written_as_the_release():
    path = Path(resolve_model_path(PRESET))
    quant = json.loads((path / "config.json").read_text())["quantization_config"]
    # config.json: the converted form only (no legacy keys mixed in), with this preset's recipe.
    assert quant == {**RELEASE_CONFIG, "ignore": quant["ignore"]}
    assert quant["ignore"] == sorted({"lm_head", "*mixer.conv1d*", "backbone.layers.3.mixer*",
                                      "backbone.layers.2.mixer*"})  # fmt: skip
    legacy = json.loads((path / HF_QUANT_CONFIG).read_text())
    assert legacy["quantization"] == {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                      "exclude_modules": quant["ignore"]}  # fmt: skip
    ckpt = _checkpoint(str(path))
    base = _checkpoint(resolve_model_path("tiny-nemotron-h"))
    fp8 = {n for n, t in ckpt.items() if t.dtype == FP8_DTYPE}
    assert {"backbone.layers.0.mixer.in_proj.weight", "backbone.layers.1.mixer.experts.3.up_proj.weight",
            "backbone.layers.1.mixer.shared_experts.down_proj.weight", "backbone.layers.5.mixer.up_proj.weight"} <= fp8  # fmt: skip
    for name in fp8:
        module = name.removesuffix(".weight")
        scale, act = ckpt[module + ".weight_scale"], ckpt[module + ".input_scale"]
        assert scale.dtype == act.dtype == torch.float32 and scale.shape == act.shape == ()
        assert 0 < act.item() and not any(fnmatchcase(module, p) for p in quant["ignore"])
        # One scale for the tensor: its largest magnitude lands on e4m3's largest value, 448.
        assert ckpt[name].float().abs().max().item() == 448.0
        dense = base[name]
        assert ((ckpt[name].float() * scale - dense).abs() <= 2**-4 * dense.abs() + 2**-10 * scale).all()
    # The recipe's modules kept: the attention layer, the Mamba layer feeding it, every conv1d, the head.
    for name in ("backbone.layers.3.mixer.q_proj.weight", "backbone.layers.2.mixer.in_proj.weight",
                 "backbone.layers.0.mixer.conv1d.weight", "lm_head.weight", "backbone.embeddings.weight"):  # fmt: skip
        assert torch.equal(ckpt[name], base[name]), name
    # The FP8 KV cache's scales, on k_proj / v_proj as the release has them.
    for kind in "kv":
        s = ckpt[f"backbone.layers.3.mixer.{kind}_proj.{kind}_scale"]
        assert s.dtype == torch.float32 and s.shape == () and s.item() > 0
    assert set(ckpt) - {n for n in ckpt if n.endswith(("_scale", ".input_scale"))} == set(base)


@pytest.fixture(scope="module")
def legacy_only(tmp_path_factory) -> str:
    """The preset with its format in hf_quant_config.json only (ModelOpt's older exports)."""
    src, out = Path(resolve_model_path(PRESET)), tmp_path_factory.mktemp("modelopt-legacy")
    for f in src.iterdir():
        shutil.copy(f, out / f.name)
    cfg = json.loads((src / "config.json").read_text())
    del cfg["quantization_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def test_served_on_cpu_as_its_dequantized_weights_with_its_kv_scales(legacy_only):
    path = resolve_model_path(PRESET)
    model = load_model(load_hf_config(path), path, torch.float32, "cpu")
    ref_path = dequantized_checkpoint(path)
    ref = load_model(load_hf_config(ref_path), ref_path, torch.float32, "cpu")
    got, want = _params(model), _params(ref)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    # (and the dequantized weights are the FP8 ones: a quantized tensor's values changed, a kept one's not)
    base = _params(load_model(load_hf_config(resolve_model_path("tiny-nemotron-h")),
                              resolve_model_path("tiny-nemotron-h"), torch.float32, "cpu"))  # fmt: skip
    assert not torch.equal(
        got["backbone.layers.0.mixer.in_proj.weight"], base["backbone.layers.0.mixer.in_proj.weight"]
    )
    assert torch.equal(
        got["backbone.layers.3.mixer.q_proj.weight"], base["backbone.layers.3.mixer.q_proj.weight"]
    )
    ckpt = _checkpoint(path)
    attn = model.backbone.layers[3].mixer.attn
    assert (attn.k_scale, attn.v_scale) == (
        ckpt["backbone.layers.3.mixer.k_proj.k_scale"].item(),
        ckpt["backbone.layers.3.mixer.v_proj.v_scale"].item(),
    )
    legacy = load_model(load_hf_config(legacy_only), legacy_only, torch.float32, "cpu")
    assert all(torch.equal(v, got[k]) for k, v in _params(legacy).items())


def test_cuda_layout_holds_the_checkpoints_bytes_with_each_scale_in_its_grid():
    """The CUDA layout built on the CPU (FP8 linears and experts): every FP8 linear and expert holds the
    checkpoint's bytes with its scalar in every block; the modules the checkpoint keeps stay dense; each
    FP8 module's dequantized weight is exactly the dequantized model's parameter."""
    path = resolve_model_path(PRESET)
    cfg = load_hf_config(path)
    model = load_model(
        cfg, path, torch.float32, "cpu", meta=build_meta_model(cfg, "cpu", Fp8Layout(True, True))
    )
    ckpt = _checkpoint(path)
    ref = _params(load_model(load_hf_config(dequantized_checkpoint(path)), dequantized_checkpoint(path),
                             torch.float32, "cpu"))  # fmt: skip
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear)}
    fp8_linears = {
        n.removesuffix(".weight") for n, t in ckpt.items() if t.dtype == FP8_DTYPE and ".experts." not in n
    }
    assert set(linears) == fp8_linears
    for name, m in linears.items():
        assert torch.equal(_bits(m.weight), _bits(ckpt[name + ".weight"])), name
        assert (m.weight_scale_inv == ckpt[name + ".weight_scale"]).all(), name
        assert torch.equal(m.dequantized_weight(torch.float32), ref[name + ".weight"]), name
    for name in ("backbone.layers.3.mixer.q_proj", "backbone.layers.2.mixer.in_proj"):
        assert type(model.get_submodule(name)) is not Fp8BlockLinear, name
    experts = model.backbone.layers[1].mixer.experts
    assert isinstance(experts, RoutedExperts) and experts.w13.dtype == FP8_DTYPE
    for e in range(experts.w13.shape[0]):
        for attr, proj in (("w13", "up_proj"), ("w2", "down_proj")):
            key = f"backbone.layers.1.mixer.experts.{e}.{proj}"
            assert torch.equal(_bits(getattr(experts, attr)[e]), _bits(ckpt[key + ".weight"]))
            assert (getattr(experts, attr + "_weight_scale_inv")[e] == ckpt[key + ".weight_scale"]).all()
    for attr in ("w13", "w2"):
        deq = dequantize_block_fp8(getattr(experts, attr), getattr(experts, attr + "_weight_scale_inv"))
        assert torch.equal(deq, ref[f"backbone.layers.1.mixer.experts.{attr}"])


# An FP8 checkpoint that keeps modules dense, each case: the preset it is copied from, the modules kept
# (shell patterns over its checkpoint names), the list its config names them by (None: the same), and our
# linears that must then stay dense, exactly (every other FP8 linear of the preset stays FP8).
DENSE_CASES = {
    # Granite renames self_attn / mamba to mixer and splits the shared MLP's input_linear into gate / up.
    "granite": ("tiny-granite-4.0-h-fp8", ["*self_attn*", "model.layers.0.shared_mlp.input_linear"], None,
                {"model.layers.1.mixer." + p for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
                | {"model.layers.0.mlp.shared_mlp.gate_proj", "model.layers.0.mlp.shared_mlp.up_proj"}),
    # Nemotron-H names its checkpoint backbone.*; an export may list transformers' names (model.*). An
    # expert kept dense keeps the stacked experts dense.
    "nemotron_h": ("tiny-nemotron-h-fp8-modelopt",
                   ["backbone.layers.5.mixer*", "*layers.1.mixer.experts.0.*"],
                   ["model.layers.5.mixer*", "model.layers.1.mixer.experts.0*"],
                   {"backbone.layers.5.mixer.up_proj", "backbone.layers.5.mixer.down_proj"}),
    "bamba": ("tiny-bamba-fp8", ["*self_attn*"], None,
              {f"model.layers.{i}.mixer.{p}" for i in (1, 3)
               for p in ("q_proj", "k_proj", "v_proj", "o_proj")}),
    "lfm2": ("tiny-lfm2-fp8", ["*self_attn*"], None,
             {"model.layers.2.mixer." + p for p in ("q_proj", "k_proj", "v_proj", "o_proj")}),
}  # fmt: skip


def _fp8_linears(model: nn.Module) -> set[str]:
    return {n for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear)}


@pytest.mark.parametrize("case", sorted(DENSE_CASES))
def test_a_module_is_fp8_exactly_where_its_checkpoint_tensors_are(case, tmp_path):
    """CUDA's layout (built on the CPU) follows the checkpoint's tensors through each model's renames and
    splits, whatever names its ignore list uses: a module whose checkpoint weight is dense stays an
    nn.Linear holding that tensor as it is (before: the list was matched against our names, so
    `*self_attn*` matched nothing on Granite / Bamba / LFM2, Granite's split input_linear became FP8,
    and the dense tensor was quantized at load)."""
    preset, patterns, listed, dense = DENSE_CASES[case]
    src = resolve_model_path(preset)
    path = keep_dense(src, tmp_path / case, patterns, listed)
    layout = Fp8Layout(True, True)
    before = _fp8_linears(build_meta_model(load_hf_config(src), "cpu", layout))
    cfg = load_hf_config(path)
    model = load_model(cfg, path, torch.float32, "cpu", meta=build_meta_model(cfg, "cpu", layout))
    assert dense <= before and _fp8_linears(model) == before - dense
    ckpt, ref = _checkpoint(path), _params(load_model(load_hf_config(src), src, torch.float32, "cpu"))
    for name in dense:
        assert torch.equal(model.get_submodule(name).weight, ref[name + ".weight"]), name
    if case == "nemotron_h":
        assert ckpt["backbone.layers.1.mixer.experts.0.up_proj.weight"].dtype == torch.float32
        assert model.backbone.layers[1].mixer.experts.w13.dtype == torch.float32
        experts = model.backbone.layers[1].mixer.experts
        assert torch.equal(experts.w13, ref["backbone.layers.1.mixer.experts.w13"])


def test_without_its_tensors_the_config_lists_the_dense_modules(tmp_path):
    """Planning from a config alone (no weights to read): the ignore list's names and patterns decide."""
    src = Path(resolve_model_path(PRESET))
    for name in ("config.json", HF_QUANT_CONFIG):
        shutil.copy(src / name, tmp_path / name)
    cfg = load_hf_config(str(tmp_path))
    model = build_meta_model(cfg, "cpu", Fp8Layout(True, True))
    dense = fp8_dense_modules(model, model.quant_config, str(tmp_path))
    assert {"backbone.layers.3.mixer.q_proj", "backbone.layers.2.mixer.in_proj", "lm_head"} <= dense
    assert "backbone.layers.0.mixer.in_proj" in _fp8_linears(model) and not dense & _fp8_linears(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_cuda_the_fp8_modules_hold_the_bytes_and_run_the_block_gemm():
    """Loaded on CUDA (not run on a GPU yet: no GPU in this task): the FP8 linears and experts hold the
    checkpoint's bytes; each linear's Triton block GEMM on the uniform grid against a float64 reference
    from the checkpoint's own tensors (its weight times its weight_scale, never the layer's grid), on the
    activations quantized per token and 128-column group as the kernel does, within the kernel tests'
    summation bound (test_fp8_gemm_triton's SUM_TOL for CUDA, 2^-10 of the terms' magnitudes): a grid
    holding another scale than the checkpoint's is off by that ratio, far outside it."""
    from sglang.srt.layers.quantization import fp8_kernel as fk

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton has e4m3fn from compute capability 8.9")
    path = resolve_model_path(PRESET)
    model = load_model(load_hf_config(path), path, torch.float32, "cuda")
    ckpt = _checkpoint(path)
    linears = _fp8_linears(model)
    assert linears == {
        n.removesuffix(".weight") for n, t in ckpt.items() if t.dtype == FP8_DTYPE and ".experts." not in n
    }
    g = torch.Generator().manual_seed(0)
    for name in linears:
        m = model.get_submodule(name)
        assert m._kernel is not None and torch.equal(_bits(m.weight.cpu()), _bits(ckpt[name + ".weight"]))
        x = torch.randn(5, m.in_features, generator=g).cuda()
        got = m(x).double().cpu()
        aq, a_s = fk.per_token_group_quant_fp8_torch(x)
        xq = fk.dequantize_block_fp8(aq, a_s, (1, 128)).double().cpu()
        w = ckpt[name + ".weight"].double() * ckpt[name + ".weight_scale"].double()
        want, magnitude = xq @ w.t(), xq.abs() @ w.abs().t()
        assert ((got - want).abs() <= 2**-10 * magnitude).all(), name
    experts = model.backbone.layers[1].mixer.experts
    assert experts.w13.dtype == FP8_DTYPE
    assert torch.equal(
        _bits(experts.w13[0].cpu()), _bits(ckpt["backbone.layers.1.mixer.experts.0.up_proj.weight"])
    )
