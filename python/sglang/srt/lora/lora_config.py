"""A LoRA adapter as PEFT saves it (upstream's format): `adapter_config.json` and
`adapter_model.safetensors` in one folder.

The config's `r`, `lora_alpha` and `use_rslora` give the scaling (alpha / r, or alpha / sqrt(r) with
rsLoRA, as PEFT computes it); every module the adapter changes holds
`base_model.model.<module>.lora_A.weight` ([r, in]) and `...lora_B.weight` ([out, r]), where `<module>`
is the module's path in the checkpoint's own naming (`model.layers.0.self_attn.q_proj`). The forward of
such a module is `W x + scaling * B (A x)`, PEFT's in evaluation.

Refused, each in one sentence naming the adapter: another PEFT type, DoRA, per-module ranks or alphas
(`rank_pattern`, `alpha_pattern`), trained biases or whole modules (`bias`, `modules_to_save`),
embedding LoRA, transposed (Conv1D) weights, a rank over --max-lora-rank, `.bin` weights.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."
_A, _B = ".lora_A.weight", ".lora_B.weight"


def adapter_digest(path: str) -> str:
    """A digest of the adapter's files (its config and weights): the id of an adapter of --lora-paths is
    its name and this, so that prefixes cached under it (on disk too: --hicache-storage-backend file)
    are never another adapter's, after a restart with other files under the same name."""
    import hashlib

    h = hashlib.blake2b(digest_size=16)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        with open(Path(path) / name, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        h.update(b"\x00")
    return h.hexdigest()


class LoRAAdapterError(ValueError):
    """An adapter this server cannot serve (the message names it and why)."""


@dataclass
class LoRAAdapter:
    """One adapter read from disk: `weights[module] = (A [r, in], B [out, r])`, float32 on the host,
    the scaling not yet applied."""

    name: str
    path: str
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def modules(self) -> list[str]:
        return sorted(self.weights)


def read_adapter_config(name: str, path: str) -> dict:
    folder = Path(path)
    config_file = folder / CONFIG_FILE
    if not config_file.is_file():
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {path} has no {CONFIG_FILE} (a PEFT adapter folder).")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_file} is not readable JSON ({e}).") from None
    if not isinstance(config, dict):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {config_file} is not a JSON object.")
    return config


def _scaling(name: str, config: dict) -> tuple[int, float]:
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"LoRA adapter {name!r} is a {peft_type} adapter; only LoRA adapters are served.")
    refusals = {
        "use_dora": "DoRA adapters are not served",
        "rank_pattern": "per-module ranks (rank_pattern) are not served",
        "alpha_pattern": "per-module alphas (alpha_pattern) are not served",
        "modules_to_save": "adapters that train whole modules (modules_to_save) are not served",
        "fan_in_fan_out": "transposed (Conv1D) LoRA weights are not served",
    }
    for key, why in refusals.items():
        if config.get(key):
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {why}.")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"LoRA adapter {name!r}: adapters with trained biases (bias) are not served.")
    rank, alpha = config.get("r"), config.get("lora_alpha", config.get("r"))
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: r must be a positive integer, not {rank!r}.")
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise LoRAAdapterError(f"LoRA adapter {name!r}: lora_alpha must be a number, not {alpha!r}.")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    return rank, float(scaling)


def read_adapter(name: str, path: str, max_rank: int | None = None) -> LoRAAdapter:
    """The adapter at `path` (a folder), checked; LoRAAdapterError naming it otherwise."""
    from safetensors import safe_open

    config = read_adapter_config(name, path)
    rank, scaling = _scaling(name, config)
    if max_rank is not None and rank > max_rank:
        raise LoRAAdapterError(
            f"LoRA adapter {name!r} has rank {rank}, over --max-lora-rank {max_rank}; start the server with "
            f"a larger --max-lora-rank."
        )
    weights_file = Path(path) / WEIGHTS_FILE
    if not weights_file.is_file():
        raise LoRAAdapterError(
            f"LoRA adapter {name!r}: {path} has no {WEIGHTS_FILE} (weights in .bin files are not read)."
        )
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            if not key.startswith(PREFIX) or not key.endswith((_A, _B)):
                raise LoRAAdapterError(
                    f"LoRA adapter {name!r} holds {key}, which is not a LoRA A or B weight of a linear "
                    f"module (embedding LoRA and trained biases are not served)."
                )
            module, which = key[len(PREFIX) : -len(_A)], key[-len(_A) :]
            pieces.setdefault(module, {})[which] = f.get_tensor(key).float()
    weights = {}
    for module, ab in pieces.items():
        a, b = ab.get(_A), ab.get(_B)
        if a is None or b is None:
            raise LoRAAdapterError(f"LoRA adapter {name!r}: {module} has only one of lora_A and lora_B.")
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise LoRAAdapterError(
                f"LoRA adapter {name!r}: {module}'s lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} are "
                f"not [r, in] and [out, r] with r = {rank}."
            )
        weights[module] = (a.contiguous(), b.contiguous())
    if not weights:
        raise LoRAAdapterError(f"LoRA adapter {name!r}: {weights_file} holds no LoRA weights.")
    return LoRAAdapter(name=name, path=str(path), rank=rank, scaling=scaling, weights=weights)


def write_adapter(
    path: str | Path,
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
    rank: int,
    alpha: float,
    base_model: str = "",
    use_rslora: bool = False,
) -> None:
    """Write an adapter in PEFT's format (what PEFT's `save_pretrained` writes: the tests' adapters and
    `sglang.tools.make_tiny_lora`)."""
    from safetensors.torch import save_file

    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    modules = sorted({m.rsplit(".", 1)[-1] for m in weights})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0,
        "target_modules": modules, "bias": "none", "use_rslora": use_rslora, "use_dora": False,
        "fan_in_fan_out": False, "modules_to_save": None, "base_model_name_or_path": base_model,
    }  # fmt: skip
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    tensors = {}
    for module, (a, b) in weights.items():
        tensors[f"{PREFIX}{module}{_A}"] = a.contiguous()
        tensors[f"{PREFIX}{module}{_B}"] = b.contiguous()
    save_file(tensors, str(folder / WEIGHTS_FILE))
