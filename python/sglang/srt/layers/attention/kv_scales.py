"""The checkpoint's float8 KV cache scales (`--kv-cache-dtype fp8_e4m3` / `fp8_e5m2`): one `k_scale` and
one `v_scale` per full-attention layer, as upstream names them. Checkpoints put them beside the
attention (`...self_attn.k_scale`), on its projections (`...self_attn.k_proj.k_scale`,
`...v_proj.v_scale`, ModelOpt's layout) or on the attention op (`...self_attn.attn.k_scale`); all three
land on the layer's `RadixAttention`. They are scalars: a float8 pool stores K / k_scale and the
backends read it back multiplied, both with the layer's `kv_scales`, which `resolve_kv_scales` sets once
for the pool's dtype (at start, and after a weight update that may have changed them)."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable

import torch
from torch import nn

from sglang.srt.layers.radix_attention import RadixAttention

logger = logging.getLogger(__name__)

KV_SCALE_NAMES = ("k_scale", "v_scale")
# The --kv-cache-dtype value of each float8 pool dtype (for the warning).
FLOAT8_FLAG_NAMES = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}
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


def resolve_kv_scales(
    models: Iterable[nn.Module | None], kv_dtype: torch.dtype, warn: bool = True
) -> list[tuple[float, float]]:
    """Sets every `RadixAttention.kv_scales` of `models` for a KV pool of `kv_dtype` and returns them in
    module order: a float8 pool's are the checkpoint's (k_scale, v_scale), 1.0 where it has none, with
    one warning (`warn`: at start only, not after a weight update or model swap), as upstream; any other
    pool stores values as they are (1.0, 1.0). The backends read the pair at each forward; a change after
    capture needs the CUDA graphs captured again (the model runner compares the lists)."""
    float8, out, unscaled = kv_dtype.itemsize == 1, [], None
    for model in models:
        for layer in model.modules() if model is not None else ():
            if not isinstance(layer, RadixAttention):
                continue
            k, v = (layer.k_scale, layer.v_scale) if float8 else (1.0, 1.0)
            if (k is None or v is None) and unscaled is None:
                unscaled = layer.layer_id
            layer.kv_scales = (1.0 if k is None else k, 1.0 if v is None else v)
            out.append(layer.kv_scales)
    if unscaled is not None and warn:
        logger.warning(
            "--kv-cache-dtype %s: the checkpoint has no k_scale / v_scale for layer %d (and maybe others); "
            "their K and V are stored with scale 1.0, so values beyond the float8 range saturate and "
            "small ones lose precision.",
            FLOAT8_FLAG_NAMES.get(kv_dtype, kv_dtype), unscaled,
        )  # fmt: skip
    return out
