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
of the tensors the loaded model holds. With EAGLE / NEXTN the checkpoint's MTP layer, which loads
beside the model, is counted too (`draft_layers`).

Tensor / expert parallelism: the count is one rank's (TP rank 0's, which holds at least every other's:
only the vocabulary's padding differs). Inside a rank its groups say the sizes; a process that joined no
group plans for `tp_size` / `ep_size` under `planned_parallel`, which makes the layers see rank 0 of
groups of those sizes while nothing but shapes is computed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.distributed import parallel_state
from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, SCALE_SUFFIX
from sglang.srt.models.registry import build_meta_model, served_dtype
from sglang.srt.speculative.draft_layers import build_meta_draft_layers


@dataclass(frozen=True)
class WeightBytes:
    total: int
    fp8_params: int  # weights held in FP8 (their scales are in `total`)
    dense_params: int  # weights held in the serving dtype (or float32)


@contextmanager
def planned_parallel(tp_size: int = 1, ep_size: int = 1) -> Iterator[None]:
    """Shapes as TP rank 0 of `tp_size` ranks (EP `ep_size`) sees them, in a process that joined no group
    (the planner's; inside a rank, and at one rank, the real groups answer). No collective may run:
    the stand-in groups have no process group behind them."""
    if (tp_size == 1 and ep_size == 1) or parallel_state.model_parallel_is_initialized():
        yield
        return
    single = parallel_state.GroupCoordinator(ranks=[0], rank_in_group=0)
    parallel_state._TP = parallel_state.GroupCoordinator(list(range(tp_size)), 0)
    parallel_state._EP = parallel_state.GroupCoordinator(list(range(ep_size)), 0) if ep_size > 1 else single
    try:
        yield
    finally:
        parallel_state._TP = parallel_state._EP = None


def weight_bytes_from_config(
    hf_config: Any,
    dtype: torch.dtype,
    device: str = "cuda",
    tp_size: int = 1,
    ep_size: int = 1,
    draft_layers: bool = False,
) -> WeightBytes:
    """What the weights of the model `hf_config` describes take on `device`, on one rank of `tp_size`
    (`ep_size`) where the process joined no group (module docstring). `draft_layers`: with the MTP
    layer EAGLE / NEXTN loads beside the model (`speculative/draft_layers.py`), laid out as `load_mtp`
    lays it out (FP8 modules where the model's are, `build_mtp`) and counted as the model is."""
    with planned_parallel(tp_size, ep_size):
        return weight_bytes_of(build_meta_model(hf_config, device), dtype, draft_layers)


def weight_bytes_of(model: torch.nn.Module, dtype: torch.dtype, draft_layers: bool = False) -> WeightBytes:
    """`weight_bytes_from_config`'s count for `model`, built on the meta device by `build_meta_model`
    (a start on CUDA counts the model it then loads: `load_model`'s `meta`)."""
    modules = [model] + ([build_meta_draft_layers(model)] if draft_layers else [])
    total = fp8 = dense = 0
    for module in modules:  # (each counted as `materialize` allocates it: the MTP layer on its own)
        for name, param in module.named_parameters():
            total += param.numel() * served_dtype(module, name, param, dtype).itemsize
            if param.dtype == FP8_DTYPE:
                fp8 += param.numel()
            elif not name.endswith(SCALE_SUFFIX):
                dense += param.numel()
    return WeightBytes(total, fp8, dense)
