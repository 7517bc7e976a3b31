"""The checkpoint's float8 KV cache scales (`--kv-cache-dtype fp8_e4m3` / `fp8_e5m2`): one `k_scale` and
one `v_scale` per full-attention layer, as upstream names them. Checkpoints put them beside the
attention (`...self_attn.k_scale`), on its projections (`...self_attn.k_proj.k_scale`,
`...v_proj.v_scale`, ModelOpt's layout) or on the attention op (`...self_attn.attn.k_scale`); all three
land on the layer's `RadixAttention`. They are scalars: a pool stores K / k_scale in float8 and the
backends read it back multiplied (`MHATokenToKVPool.layer_scales`)."""

from __future__ import annotations

import math

import torch
from torch import nn

from sglang.srt.layers.radix_attention import RadixAttention

KV_SCALE_NAMES = ("k_scale", "v_scale")
# The module names, relative to the attention module that holds the `RadixAttention`, a scale may sit on.
_PLACES = ("", ".attn", ".k_proj", ".v_proj")


class KVScaleLoader:
    """Takes a checkpoint's k_scale / v_scale tensors (names after the model's renames) to their layers."""

    def __init__(self, model: nn.Module):
        self.targets: dict[str, RadixAttention] = {}
        self.pending: list[tuple[RadixAttention, str, float]] = []  # set by `apply`, after the weights
        for name, module in model.named_modules():
            if isinstance(module, RadixAttention):
                owner = name.rpartition(".")[0]
                self.targets.update({owner + place: module for place in _PLACES})

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Takes the scale `name` names (set by `apply`) and returns True; False for any other tensor.
        ValueError for a scale that is not one positive finite number (per-channel scales are not
        served)."""
        owner, _, kind = name.rpartition(".")
        if kind not in KV_SCALE_NAMES or owner not in self.targets:
            return False
        if tensor.numel() != 1:
            raise ValueError(
                f"Checkpoint tensor {name} has {tensor.numel()} values; one {kind} per layer is served."
            )
        value = float(tensor.float().reshape(()))
        if not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"Checkpoint tensor {name} is {value}; a KV cache scale must be positive and finite."
            )
        self.pending.append((self.targets[owner], kind, value))
        return True

    def apply(self) -> None:
        """Sets the scales taken: once the weights loaded with them are all written (a weight update is all
        or nothing, and a refused one changed a scale it had taken)."""
        for layer, kind, value in self.pending:
            setattr(layer, kind, value)
        self.pending.clear()
