"""Rewrite an unquantized checkpoint in the published block-wise FP8 format, in place or into another folder.

    python -m sglang.tools.quantize_fp8 --src DIR [--out DIR]
    python -m sglang.tools.make_tiny_model --arch qwen3_next --out DIR --quantize fp8-block

As Qwen's FP8 releases (Qwen3-Next-80B-A3B-Instruct-FP8, Qwen3.5-*-FP8) are written: each linear weight
the format quantizes (`quantizable_by_default`: not embeddings, lm_head, norms, convs, routers, gates,
the Gated DeltaNet's b/a projections) becomes float8_e4m3fn with `<name>_scale_inv`, float32, one per
128 x 128 block (amax / 448; the last block of a dimension that does not divide by 128 is partial);
stacked experts (Granite's 3-D `input_linear`) get one block grid per expert. Every other tensor keeps its
dtype, and so does the MTP layer's `mtp.fc` (as Qwen's releases keep it); fused 3-D experts
(`experts.gate_up_proj`, `experts.down_proj`) are written per expert, as the releases store them.
config.json gets `quantization_config` (quant_method fp8, fmt e4m3, activation_scheme dynamic,
weight_block_size [128, 128], modules_to_not_convert: the modules left unquantized). Deterministic: the
same checkpoint gives the same bytes.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sglang.srt.layers.quantization.fp8 import (
    DEFAULT_BLOCK,
    SCALE_SUFFIX,
    Fp8Config,
    quantizable_by_default,
    quantize_block_fp8,
)

WEIGHTS = "model.safetensors"
# Tensors the releases keep beyond `quantizable_by_default`'s rule: the MTP layer's `fc` (Qwen3-Next-80B-
# A3B-*-FP8 lists `mtp.fc` in modules_to_not_convert with the MTP layer's norms and gates).
KEPT_IN_RELEASES = ("mtp.fc.weight",)


def quantize_checkpoint(
    src: str | Path, out: str | Path | None = None, block: tuple[int, int] = DEFAULT_BLOCK
) -> Path:
    """Write `src` (a single-file safetensors checkpoint) as block-FP8 into `out` (default: `src`)."""
    src = Path(src)
    out = Path(out) if out is not None else src
    if out != src:
        shutil.copytree(src, out, dirs_exist_ok=True)
    tensors = _per_expert(load_file(str(src / WEIGHTS)))
    written, kept, quantized = {}, set(), set()
    for name in sorted(tensors):
        tensor = tensors[name]
        module = name.removesuffix(".weight").removesuffix(".bias")
        if quantizable_by_default(name, tensor) and name not in KEPT_IN_RELEASES:
            written[name], written[name + SCALE_SUFFIX] = quantize_block_fp8(tensor, block)
            quantized.add(module)
        else:
            written[name] = tensor.contiguous()
            kept.add(module)
    kept -= quantized  # a quantized linear's bias stays as it is; the module is quantized all the same
    save_file(written, str(out / WEIGHTS), metadata={"format": "pt"})
    config_path = out / "config.json"
    cfg = json.loads(config_path.read_text())
    quant = Fp8Config(weight_block_size=tuple(block), ignored_layers=tuple(sorted(kept)))
    cfg["quantization_config"] = quant.to_quantization_config()
    config_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out


def _per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused 3-D experts (`X.experts.gate_up_proj` [E, 2 * inter, hidden], `X.experts.down_proj`
    [E, hidden, inter]: the tiny presets' MTP layer) as the published FP8 checkpoints store experts, one
    `X.experts.E.{gate,up,down}_proj.weight` each (quantized one by one); other tensors unchanged."""
    out = {}
    for name, tensor in tensors.items():
        module, _, proj = name.rpartition(".")
        if not (module.endswith(".experts") and proj in ("gate_up_proj", "down_proj") and tensor.dim() == 3):
            out[name] = tensor
            continue
        for e, w in enumerate(tensor):
            if proj == "down_proj":
                out[f"{module}.{e}.down_proj.weight"] = w.contiguous()
            else:
                gate, up = w.chunk(2, dim=0)
                out[f"{module}.{e}.gate_proj.weight"] = gate.contiguous()
                out[f"{module}.{e}.up_proj.weight"] = up.contiguous()
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--src", required=True, help="The unquantized checkpoint folder.")
    parser.add_argument("--out", help="Folder to write into (default: rewrite --src in place).")
    args = parser.parse_args(argv)
    print(f"Wrote a block-FP8 checkpoint to {quantize_checkpoint(args.src, args.out)}")


if __name__ == "__main__":
    main()
