"""Which model class serves which HF architecture name."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from sglang.srt.layers.quantization import quant_config_of
from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, SCALE_SUFFIX, swap_fp8_linears
from sglang.srt.models.loader import iter_checkpoint

# architecture name -> (module, class); imported on first use.
_MODELS = {
    "Qwen3NextForCausalLM": ("sglang.srt.models.qwen3_next", "Qwen3NextForCausalLM"),
    "NemotronHForCausalLM": ("sglang.srt.models.nemotron_h", "NemotronHForCausalLM"),
    "BambaForCausalLM": ("sglang.srt.models.bamba", "BambaForCausalLM"),
    "Lfm2ForCausalLM": ("sglang.srt.models.lfm2", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("sglang.srt.models.lfm2", "Lfm2ForCausalLM"),
    "FalconH1ForCausalLM": ("sglang.srt.models.falcon_h1", "FalconH1ForCausalLM"),
    "GraniteMoeHybridForCausalLM": ("sglang.srt.models.granitemoehybrid", "GraniteMoeHybridForCausalLM"),
    "Qwen3_5ForCausalLM": ("sglang.srt.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("sglang.srt.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("sglang.srt.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("sglang.srt.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
}


def get_model_class(hf_config: Any) -> type[nn.Module]:
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in _MODELS:
            module, cls = _MODELS[arch]
            return getattr(importlib.import_module(module), cls)
    raise ValueError(
        f"No model class for architectures {getattr(hf_config, 'architectures', None)!r}; "
        f"supported: {', '.join(sorted(_MODELS))}."
    )


def load_model(hf_config: Any, path: str, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """Build the model for `hf_config` in `dtype` on `device` and load the checkpoint at `path`.

    The model is built on the meta device and each parameter is then allocated once, in its serving
    dtype on `device`, for the checkpoint to fill: no random initialisation and no float32 copy first
    (an 80B model in bfloat16 never needs twice its memory on the host)."""
    quant = quant_config_of(hf_config)
    with torch.device("meta"):
        model = get_model_class(hf_config)(hf_config)
        if quant is not None and torch.device(device).type == "cuda":
            # FP8 linears on CUDA (the block GEMM); on CPU the weights load dequantized (`fp8.py`).
            ignored = {
                model.checkpoint_name(m + ".weight").removesuffix(".weight") for m in quant.ignored_layers
            }
            swap_fp8_linears(model, quant, model.fp8_dense_modules, ignored)
    model.quant_config = quant
    materialize(model, dtype, torch.device(device))
    model.load_weights(iter_checkpoint(path))
    # Children first: a module's own step may read what its children's made (a decoder layer's fused
    # decode blocks read its norms' and experts' C++ choices).
    for module in reversed(list(model.modules())):
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    return model.eval().requires_grad_(False)


def materialize(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter by an uninitialised one in `dtype` (float32 for the model's
    `fp32_param_suffixes`) on `device`, keeping tied parameters tied; buffers (computed at construction,
    on the host) are copied to `device` as they are."""
    keep_fp32 = getattr(model, "fp32_param_suffixes", ())
    made: dict[int, nn.Parameter] = {}
    for prefix, module in model.named_modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                full = f"{prefix}.{name}" if prefix else name
                dt = torch.float32 if keep_fp32 and full.endswith(keep_fp32) else dtype
                if param.dtype == FP8_DTYPE or full.endswith(SCALE_SUFFIX):
                    dt = param.dtype  # an FP8 linear's weight and its float32 block scales
                made[id(param)] = nn.Parameter(
                    torch.empty(param.shape, dtype=dt, device=device), requires_grad=False
                )
            module._parameters[name] = made[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is None:
                continue
            if buf.is_meta:
                raise ValueError(
                    f"Buffer {prefix}.{name} was built on the meta device; build it on the host."
                )
            module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device).copy_(buf)
