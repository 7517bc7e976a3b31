"""What the runtime knows about the model it serves: the HF config, its hybrid adapter, the weight
dtype and the context length."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import torch

from sglang.srt.configs import hybrid_arch_config
from sglang.srt.configs.hybrid_arch import HybridArchConfig
from sglang.srt.configs.presets import resolve_model_path

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# --kv-cache-dtype: the pool's storage dtype ("auto": the model's). float8 values are stored divided by
# the checkpoint's k_scale / v_scale (1.0 where it has none: `kv_scales.resolve_kv_scales`); e4m3fn
# saturates at +-448.
_KV_CACHE_DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def load_hf_config(model_path: str) -> Any:
    from transformers import AutoConfig

    path = resolve_model_path(model_path)
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"--model-path {model_path!r}: no config.json in {path}.")
    from sglang.srt.layers.quantization.modelopt import attach_hf_quant_config

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    attach_hf_quant_config(config, path)  # (a ModelOpt export that names its format there only)
    return config


def resolve_dtype(dtype: str, device: str, checkpoint_dtype: Any = None) -> torch.dtype:
    """`auto` is float32 on CPU (the CPU path is exact) and on a GPU the checkpoint's dtype (the HF
    config's `dtype`; bfloat16 for the hybrid models' published checkpoints, and where the config names
    none or one the runtime does not serve)."""
    if dtype != "auto":
        return _DTYPES[dtype]
    if device == "cpu":
        return torch.float32
    if isinstance(checkpoint_dtype, str):
        checkpoint_dtype = _DTYPES.get(checkpoint_dtype.removeprefix("torch."))
    return checkpoint_dtype if checkpoint_dtype in _DTYPES.values() else torch.bfloat16


@dataclass
class ModelConfig:
    model_path: str
    context_length: int | None = None
    dtype: str = "auto"
    device: str = "cpu"
    kv_cache_dtype: str = "auto"

    @cached_property
    def path(self) -> str:
        return resolve_model_path(self.model_path)

    @cached_property
    def hf_config(self) -> Any:
        return load_hf_config(self.model_path)

    @cached_property
    def arch(self) -> HybridArchConfig:
        return hybrid_arch_config(self.hf_config)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto" or self.device == "cpu":
            return resolve_dtype(self.dtype, self.device)
        checkpoint = getattr(self.hf_config, "dtype", None) or getattr(self.arch.hf_config, "dtype", None)
        return resolve_dtype(self.dtype, self.device, checkpoint)

    @property
    def kv_cache_torch_dtype(self) -> torch.dtype:
        """The full-attention KV pool's dtype (`--kv-cache-dtype`)."""
        if self.kv_cache_dtype == "auto":
            return self.torch_dtype
        return _KV_CACHE_DTYPES[self.kv_cache_dtype]

    @property
    def context_len(self) -> int:
        return self.context_length or self.arch.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.arch.vocab_size
