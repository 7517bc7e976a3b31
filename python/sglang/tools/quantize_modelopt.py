"""Rewrite an unquantized checkpoint in NVIDIA ModelOpt's FP8 format (how the Nemotron FP8 releases are
published), in place or into another folder.

    python -m sglang.tools.quantize_modelopt --src DIR [--out DIR]
    python -m sglang.tools.make_tiny_model --arch nemotron_h --out DIR --quantize fp8-modelopt

Each linear weight the format quantizes (`quantizable_by_default`, outside the `exclude` patterns) becomes
float8_e4m3fn with `<module>.weight_scale` (float32, shape []: the tensor's largest magnitude / 448) and
`<module>.input_scale` (float32, shape []: the largest magnitude of the module's input over a calibration
forward of the transformers model, / 448); every attention's `k_proj.k_scale` / `v_proj.v_scale` are its
keys' and values' largest magnitude / 448 (the FP8 KV cache's scales). Every other tensor keeps its dtype.
config.json gets `quantization_config` in the form ModelOpt's exporter converts to (`converted_config`:
quant_method modelopt, quant_algo FP8, config_groups, kv_cache_scheme FP8, ignore: the patterns) and
hf_quant_config.json ModelOpt's older layout (quant_algo, kv_cache_quant_algo, exclude_modules).

Excluded by default (`default_excludes`): lm_head, and for Nemotron-H the recipe of the Nemotron-3-Nano FP8
release: every Mamba conv1d, every attention layer and the Mamba layer feeding each attention layer.
Deterministic: the same checkpoint gives the same bytes."""

from __future__ import annotations

import argparse
import json
import shutil
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, FP8_MAX, quantizable_by_default
from sglang.srt.layers.quantization.modelopt import HF_QUANT_CONFIG

WEIGHTS = "model.safetensors"
PRODUCER = {"name": "modelopt", "version": "0.37.0"}  # (the tiny presets' stand-in; no library runs)
CALIBRATION_TOKENS = 96


def default_excludes(cfg: dict[str, Any]) -> list[str]:
    excludes = ["lm_head"]
    kinds = cfg.get("layers_block_type")
    if cfg.get("model_type") == "nemotron_h" and kinds:
        excludes.append("*mixer.conv1d*")
        for i, kind in enumerate(kinds):
            if kind != "full_attention":
                continue
            excludes.append(f"backbone.layers.{i}.mixer*")
            feeding = [j for j in range(i) if kinds[j] == "linear_attention"]
            if feeding:
                excludes.append(f"backbone.layers.{feeding[-1]}.mixer*")
    return sorted(set(excludes))


def _excluded(module: str, patterns: list[str]) -> bool:
    return any(module == p or module.startswith(p + ".") or fnmatchcase(module, p) for p in patterns)


def _key(module: str) -> str:
    """A module's name without the backbone's own (transformers names in memory `model.` what Nemotron-H's
    checkpoint names `backbone.`)."""
    head, _, rest = module.partition(".")
    return rest if head in ("model", "backbone") and rest else module


def _calibrate(src: Path) -> tuple[dict[str, float], dict[str, float]]:
    """(largest input magnitude per module, largest output magnitude per k_proj / v_proj), by `_key`, over
    one forward of the transformers model on fixed random tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32, local_files_only=True).eval()
    inputs: dict[str, float] = {}
    outputs: dict[str, float] = {}
    hooks = []
    for full, module in model.named_modules():
        name = _key(full)

        def pre(mod, args, name=name):
            if args and isinstance(args[0], torch.Tensor) and args[0].is_floating_point():
                inputs[name] = max(inputs.get(name, 0.0), float(args[0].detach().abs().max()))

        def post(mod, args, out, name=name):
            if isinstance(out, torch.Tensor):
                outputs[name] = max(outputs.get(name, 0.0), float(out.detach().abs().max()))

        hooks.append(module.register_forward_pre_hook(pre))
        if name.endswith((".k_proj", ".v_proj")):
            hooks.append(module.register_forward_hook(post))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (1, CALIBRATION_TOKENS), generator=g)
    with torch.no_grad():
        model(input_ids=ids)
    for h in hooks:
        h.remove()
    return inputs, outputs


def _scale(amax: float) -> torch.Tensor:
    return torch.tensor(amax / FP8_MAX if amax > 0 else 1.0, dtype=torch.float32)


def _input_amax(module: str, inputs: dict[str, float]) -> float:
    """The module's own input range, else its nearest recorded parent's (a model whose experts run as one
    fused parameter calls no per-expert module)."""
    module = _key(module)
    while module:
        if module in inputs:
            return inputs[module]
        module = module.rpartition(".")[0]
    return 0.0


def converted_config(exclude: list[str]) -> dict[str, Any]:
    """config.json's `quantization_config` as ModelOpt's exporter converts hf_quant_config.json's for FP8
    with an FP8 KV cache (`modelopt.torch.export.convert_hf_config`): compressed-tensors style groups
    (static float8 weights and input scales on the Linear modules), `ignore`, and the KV cache as
    `kv_cache_scheme`; never `kv_cache_quant_algo` or `exclude_modules` (those are the legacy file's)."""
    fp8 = {"dynamic": False, "num_bits": 8, "type": "float"}
    return {
        "config_groups": {"group_0": {"input_activations": fp8, "weights": fp8, "targets": ["Linear"]}},
        "ignore": exclude,
        "kv_cache_scheme": fp8,
        "producer": PRODUCER,
        "quant_algo": "FP8",
        "quant_method": "modelopt",
    }


def quantize_checkpoint_modelopt(
    src: str | Path, out: str | Path | None = None, exclude: list[str] | None = None
) -> Path:
    """Write `src` (a single-file safetensors checkpoint) in ModelOpt's FP8 format into `out` (default:
    `src`)."""
    src = Path(src)
    out = Path(out) if out is not None else src
    cfg = json.loads((src / "config.json").read_text())
    exclude = sorted(exclude) if exclude is not None else default_excludes(cfg)
    inputs, outputs = _calibrate(src)
    if out != src:
        shutil.copytree(src, out, dirs_exist_ok=True)
    tensors = load_file(str(src / WEIGHTS))
    written: dict[str, torch.Tensor] = {}
    for name in sorted(tensors):
        tensor, module = tensors[name], name.removesuffix(".weight")
        if tensor.dim() == 2 and quantizable_by_default(name, tensor) and not _excluded(module, exclude):
            scale = _scale(float(tensor.abs().max()))
            written[name] = (tensor.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            written[module + ".weight_scale"] = scale
            written[module + ".input_scale"] = _scale(_input_amax(module, inputs))
        else:
            written[name] = tensor.contiguous()
        if module.endswith((".k_proj", ".v_proj")) and name.endswith(".weight"):
            written[f"{module}.{module[-6]}_scale"] = _scale(outputs.get(_key(module), 0.0))
    save_file(written, str(out / WEIGHTS), metadata={"format": "pt"})
    cfg["quantization_config"] = converted_config(exclude)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    legacy = {
        "producer": PRODUCER,
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": exclude},
    }
    (out / HF_QUANT_CONFIG).write_text(json.dumps(legacy, indent=2, sort_keys=True) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--src", required=True, help="The unquantized checkpoint folder.")
    parser.add_argument("--out", help="Folder to write into (default: rewrite --src in place).")
    args = parser.parse_args(argv)
    print(f"Wrote a ModelOpt FP8 checkpoint to {quantize_checkpoint_modelopt(args.src, args.out)}")


if __name__ == "__main__":
    main()
