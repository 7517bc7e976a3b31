"""Bytes a checkpoint's weights take on the device, from its config alone, before anything loads: the
memory planner refuses a model whose weights cannot fit (`pool_sizing.check_weights_fit`) and sizes
the caches of one that can, at real size, without the weights (`pool_sizing.plan_memory`).

The model is built on the meta device (its parameters have shapes and no memory), and each parameter
is counted in the dtype it will be served in: the serving dtype, float32 for the model's
`fp32_param_suffixes`; with a block-wise FP8 checkpoint on CUDA, 1 byte per weight of every quantized
linear and expert plus one float32 scale per 128 x 128 block (ceil of each dimension: a partial block
has its own scale), while the modules the checkpoint keeps unquantized (its `modules_to_not_convert`,
and what the published FP8 checkpoints never quantize: embeddings, lm_head, norms, routers and gates)
stay in the serving dtype. On CPU an FP8 checkpoint is dequantized as it loads, so it counts as dense.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.quantization import quant_config_of
from sglang.srt.layers.quantization.fp8 import Fp8Config, quantizable_by_default
from sglang.srt.models.registry import get_model_class

FP8_BYTES = 1
SCALE_BYTES = 4  # float32 block scales


@dataclass(frozen=True)
class WeightBytes:
    total: int
    fp8_params: int  # weights held in FP8 (their scales are in `total`)
    dense_params: int  # weights held in the serving dtype (or float32)


def weight_bytes_from_config(hf_config: Any, dtype: torch.dtype, device: str = "cuda") -> WeightBytes:
    """What the weights of the model `hf_config` describes take on `device` (module docstring)."""
    quant = quant_config_of(hf_config) if torch.device(device).type == "cuda" else None
    with torch.device("meta"):
        model = get_model_class(hf_config)(hf_config)
    keep_fp32 = tuple(getattr(model, "fp32_param_suffixes", ()))
    ignored = set()
    if quant is not None:
        ignored = {model.checkpoint_name(m + ".weight").removesuffix(".weight") for m in quant.ignored_layers}
    quantized: dict[int, tuple[int, ...]] = {}  # id(param) -> the matrix shape its blocks tile
    if quant is not None:
        for name, module in model.named_modules():
            for param in _fp8_weights(name, module, ignored):
                quantized[id(param)] = tuple(param.shape)
    total = fp8 = dense = 0
    for name, param in model.named_parameters():
        if id(param) in quantized:
            total += param.numel() * FP8_BYTES + _scale_count(quantized[id(param)], quant) * SCALE_BYTES
            fp8 += param.numel()
        else:
            itemsize = 4 if keep_fp32 and name.endswith(keep_fp32) else dtype.itemsize
            total += param.numel() * itemsize
            dense += param.numel()
    return WeightBytes(total, fp8, dense)


def _fp8_weights(name: str, module: nn.Module, ignored: set[str]) -> list[nn.Parameter]:
    """The weights of `module` an FP8 checkpoint stores quantized: a linear's, or an expert stack's."""
    if name in ignored:
        return []
    if type(module) is nn.Linear and quantizable_by_default(name + ".weight", module.weight):
        return [module.weight]
    if isinstance(module, RoutedExperts):
        return [module.w13, module.w2]
    return []


def _scale_count(shape: tuple[int, ...], quant: Fp8Config) -> int:
    """Block scales of a [..., rows, cols] weight: one per block of each matrix (stacked experts each
    have their own)."""
    *stack, rows, cols = shape
    b0, b1 = quant.weight_block_size
    return math.prod(stack) * math.ceil(rows / b0) * math.ceil(cols / b1)
