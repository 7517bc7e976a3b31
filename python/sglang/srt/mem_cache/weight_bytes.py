"""Bytes a checkpoint's weights take on the device, from its config alone, before anything loads: the
memory planner refuses a model whose weights cannot fit (`pool_sizing.check_weights_fit`) and sizes
the caches of one that can, at real size, without the weights (`pool_sizing.plan_memory`).

The model is built on the meta device exactly as `load_model` builds it for that device
(`registry.build_meta_model`: with a block-wise FP8 checkpoint, FP8 linears on CUDA and FP8 routed
experts where `SGLANG_FP8_EXPERTS` says), and each parameter is counted in the dtype `materialize` gives
it (`registry.served_dtype`): 1 byte per FP8 weight plus a float32 scale per 128 x 128 block (a partial
block has its own), the serving dtype for what stays dense (the modules the checkpoint keeps
unquantized, what the published FP8 checkpoints never quantize, a model's `fp8_dense_modules`, and on
CPU the dequantized linears), float32 for the model's `fp32_param_suffixes`. So the count is the bytes
of the tensors the loaded model holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, SCALE_SUFFIX
from sglang.srt.models.registry import build_meta_model, served_dtype


@dataclass(frozen=True)
class WeightBytes:
    total: int
    fp8_params: int  # weights held in FP8 (their scales are in `total`)
    dense_params: int  # weights held in the serving dtype (or float32)


def weight_bytes_from_config(hf_config: Any, dtype: torch.dtype, device: str = "cuda") -> WeightBytes:
    """What the weights of the model `hf_config` describes take on `device` (module docstring)."""
    model = build_meta_model(hf_config, device)
    total = fp8 = dense = 0
    for name, param in model.named_parameters():
        total += param.numel() * served_dtype(model, name, param, dtype).itemsize
        if param.dtype == FP8_DTYPE:
            fp8 += param.numel()
        elif not name.endswith(SCALE_SUFFIX):
            dense += param.numel()
    return WeightBytes(total, fp8, dense)
