"""A random LoRA adapter for a checkpoint, in PEFT's format, and the checkpoint with it merged (the
oracle's weights: transformers runs the merged checkpoint, PEFT's forward in evaluation being
`W x + scaling * B (A x)`).

    python -m sglang.tools.make_tiny_lora --model tiny-qwen3-next --out DIR [--targets q_proj o_proj ...]
        [--rank 8] [--alpha 16] [--seed 0] [--merged DIR]

Every linear weight of the language model whose module name is in `--targets` gets A [r, in] and
B [out, r] (seeded; B is not PEFT's zero init, so the adapter changes the outputs). Sizes: A's entries
have std 1 / sqrt(in), B's 0.02 * the weight's own std / 0.02, so scaling * B A is of the order of the
weight itself (a test that ignored the adapter would see other tokens).
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.lora.lora_config import write_adapter

WEIGHTS = "model.safetensors"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkvz", "in_proj_ba", "out_proj",
                   "gate_proj", "up_proj", "down_proj", "in_proj", "w1", "w2", "w3", "input_linear",
                   "output_linear", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")  # fmt: skip
# Never adapted: the vision tower, the MTP layer, experts (fused in this server's MoE).
_SKIPPED = ("visual", "mtp.", ".experts.")


def adapter_weights(
    model_path: str, targets: tuple[str, ...], rank: int, seed: int = 0, layers: tuple[int, ...] | None = None
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module -> (A, B) for every 2-D `<module>.weight` of the checkpoint whose module name is a target
    (in `layers` only, when given)."""
    folder = Path(resolve_model_path(model_path))
    g = torch.Generator().manual_seed(seed)
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in sorted(f.keys()):  # noqa: SIM118
                if not key.endswith(".weight") or any(s in key for s in _SKIPPED):
                    continue
                module = key[: -len(".weight")]
                if module.rsplit(".", 1)[-1] not in targets:
                    continue
                if layers is not None and not any(f".layers.{i}." in module for i in layers):
                    continue
                w = f.get_tensor(key)
                if w.ndim != 2 or not w.is_floating_point() or w.dtype.itemsize == 1:
                    continue
                n_out, n_in = w.shape
                std = float(w.float().std()) or 0.02
                a = torch.randn(rank, n_in, generator=g) / n_in**0.5
                b = torch.randn(n_out, rank, generator=g) * std
                out[module] = (a, b)
    return out


def make_tiny_lora(
    model_path: str,
    out: str | Path,
    targets: tuple[str, ...] = DEFAULT_TARGETS,
    rank: int = 8,
    alpha: float = 16,
    seed: int = 0,
    layers: tuple[int, ...] | None = None,
) -> Path:
    weights = adapter_weights(model_path, targets, rank, seed, layers)
    if not weights:
        raise ValueError(f"{model_path} has no linear weight named {list(targets)}.")
    write_adapter(out, weights, rank, alpha, base_model=str(model_path))
    return Path(out)


def merge_lora(model_path: str, adapter: str | Path, out: str | Path) -> Path:
    """The checkpoint at `model_path` with the adapter merged into its weights (W + scaling * B A, in
    float32, stored in the weight's dtype), beside its config and tokenizer files."""
    from sglang.srt.lora.lora_config import read_adapter

    src, dst = Path(resolve_model_path(model_path)), Path(out)
    shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors*"))
    lora = read_adapter("merge", str(adapter))
    left = set(lora.weights)
    for file in sorted(src.glob("*.safetensors")):
        tensors = load_file(str(file))
        for module, (a, b) in lora.weights.items():
            w = tensors.get(f"{module}.weight")
            if w is not None:
                tensors[f"{module}.weight"] = (w.float() + lora.scaling * (b @ a)).to(w.dtype)
                left.discard(module)
        save_file(tensors, str(dst / file.name), metadata={"format": "pt"})
    for index in src.glob("*.safetensors.index.json"):
        shutil.copy(index, dst / index.name)
    if left:
        raise ValueError(f"the adapter changes modules the checkpoint lacks: {sorted(left)[:3]}")
    return dst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--targets", nargs="+", default=list(DEFAULT_TARGETS))
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--alpha", type=float, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merged", default=None, help="Also write the merged checkpoint here.")
    args = p.parse_args()
    path = make_tiny_lora(args.model, args.out, tuple(args.targets), args.rank, args.alpha, args.seed)
    print(f"adapter: {path}")
    if args.merged:
        print(f"merged: {merge_lora(args.model, path, args.merged)}")


if __name__ == "__main__":
    main()
