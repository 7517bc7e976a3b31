"""Quantized weights: which format a checkpoint's `quantization_config` asks for (block-wise FP8,
`fp8.py`; NVIDIA ModelOpt's per-tensor FP8, `modelopt.py`, read as block FP8), and `--quantization`
(upstream's flag: `fp8` quantizes an unquantized checkpoint block-wise as it loads; `modelopt` /
`modelopt_fp8` name a ModelOpt FP8 checkpoint).

The model code stays format-free: the loader hands FP8 tensors over dequantized, except to the FP8
modules, which on CUDA replace the `nn.Linear`s and experts before loading and take the checkpoint's
FP8 bytes and scales (`Fp8BlockLinear`, `fp8_experts.py`; DESIGN section 5c)."""

from __future__ import annotations

from typing import Any

from sglang.srt.layers.quantization.fp8 import Fp8Config, Fp8ConfigError
from sglang.srt.layers.quantization.modelopt import (
    MODELOPT_FLAGS,
    check_flag_on_checkpoint,
    is_modelopt,
    modelopt_fp8_config,
)

# --quantization values this server implements.
QUANTIZATION_METHODS = ("fp8", *MODELOPT_FLAGS)
# The hf_config attribute `--quantization` sets (the config travels to the scheduler and loader).
ONLINE_ATTR = "sglang_online_quantization"

__all__ = [
    "QUANTIZATION_METHODS",
    "Fp8Config",
    "Fp8ConfigError",
    "check_quantization_flag",
    "checkpoint_quant_config",
    "quant_config_of",
]


def check_quantization_flag(method: str | None) -> str | None:
    """One sentence where `--quantization` names a method not implemented here, else None."""
    if method is None or method in QUANTIZATION_METHODS:
        return None
    return (
        f"--quantization {method} is not supported by this server: it implements "
        "fp8 (block-wise FP8 weights, [128, 128] blocks, quantized at load) and modelopt / modelopt_fp8 "
        "(a checkpoint NVIDIA ModelOpt quantized to FP8); FP8 checkpoints load without the flag."
    )


def set_online_quantization(hf_config: Any, method: str | None) -> None:
    """Record `--quantization` on the model's config, which the loader reads (`quant_config_of`)."""
    if method is not None:
        setattr(hf_config, ONLINE_ATTR, method)


def checkpoint_quantization(hf_config: Any, text_config: Any = None) -> Any:
    """The checkpoint's `quantization_config` (the multimodal config's, or its text config's), or None."""
    for cfg in (hf_config, text_config):
        quant = getattr(cfg, "quantization_config", None) if cfg is not None else None
        if quant:
            return quant.to_dict() if hasattr(quant, "to_dict") else quant
    return None


def checkpoint_quant_config(quant: Any) -> Fp8Config:
    """The weight format of a checkpoint's `quantization_config` (Fp8ConfigError where it is not served)."""
    if isinstance(quant, dict) and is_modelopt(quant):
        return modelopt_fp8_config(quant)
    return Fp8Config.from_quantization_config(quant)


def quant_config_of(hf_config: Any) -> Fp8Config | None:
    """The weight format to load: the checkpoint's (FP8ConfigError where it is not block-wise or ModelOpt
    FP8), or `--quantization fp8` on an unquantized checkpoint, or None. `--quantization modelopt` /
    `modelopt_fp8` on a checkpoint ModelOpt did not quantize: FP8ConfigError."""
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else None
    quant = checkpoint_quantization(hf_config, text)
    flag = getattr(hf_config, ONLINE_ATTR, None)
    config = checkpoint_quant_config(quant) if quant else None
    check_flag_on_checkpoint(flag, config)
    if config is None and flag == "fp8":
        return Fp8Config.online()
    return config
