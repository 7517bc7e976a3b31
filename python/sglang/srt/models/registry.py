"""Which model class serves which HF architecture name."""

from __future__ import annotations

import importlib
from typing import Any

import torch
from torch import nn

from sglang.srt.models.loader import iter_checkpoint

# architecture name -> (module, class); imported on first use.
_MODELS = {
    "Qwen3NextForCausalLM": ("sglang.srt.models.qwen3_next", "Qwen3NextForCausalLM"),
    "NemotronHForCausalLM": ("sglang.srt.models.nemotron_h", "NemotronHForCausalLM"),
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
    """Build the model for `hf_config` in `dtype` on `device` and load the checkpoint at `path`."""
    model = get_model_class(hf_config)(hf_config).to(device=device, dtype=dtype)
    for name, param in model.named_parameters():
        if name.endswith(getattr(model, "fp32_param_suffixes", ())):
            param.data = param.data.float()
    model.load_weights(iter_checkpoint(path))
    return model.eval().requires_grad_(False)
