"""Adapters that read a transformers config of a hybrid model and state what the runtime needs:
which layers are full attention and which are linear (recurrent), the state shapes and dtypes of a
linear layer, and the kernel state chunk (the granularity at which the prefill kernel materialises
intermediate states: 64 tokens for Gated DeltaNet, the config's `chunk_size` for Mamba2).

One adapter class per architecture registers itself with `register_hybrid_arch`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from sglang.srt.configs.mamba_utils import (
    Mamba2CacheParams,
    Mamba2StateShape,
    resolve_state_dtypes,
)
from sglang.srt.distributed import get_tensor_model_parallel_world_size
from sglang.srt.layers.quantization import quant_config_of

_REGISTRY: dict[str, type[HybridArchConfig]] = {}


def register_hybrid_arch(cls: type[HybridArchConfig]) -> type[HybridArchConfig]:
    for arch in cls.architectures:
        _REGISTRY[arch] = cls
    return cls


def supported_architectures() -> list[str]:
    return sorted(_REGISTRY)


def hybrid_arch_config(hf_config: Any) -> HybridArchConfig:
    """The adapter for `hf_config`, chosen by its `architectures` entry (or `model_type`)."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _REGISTRY:
            return _REGISTRY[arch](hf_config)
    model_type = getattr(hf_config, "model_type", None)
    for cls in _REGISTRY.values():
        if model_type in cls.model_types:
            return cls(hf_config)
    raise ValueError(
        f"Unsupported model architecture {archs or model_type!r}: this runtime serves hybrid models "
        f"({', '.join(supported_architectures())})."
    )


class HybridArchConfig(ABC):
    architectures: ClassVar[tuple[str, ...]]
    # The config's `model_type`s it serves (the fallback where `architectures` names none of ours).
    model_types: ClassVar[tuple[str, ...]]
    # "gdn" (Gated DeltaNet), "mamba2" or "short_conv" (LFM2): which backend runs the linear layers.
    linear_kind: ClassVar[str]
    # Whether the linear backend writes track snapshots (required by the extra-buffer strategies).
    supports_extra_buffer: ClassVar[bool] = True

    def __init__(self, hf_config: Any):
        # A multimodal checkpoint's config (Qwen3.5's) holds the language model's in `text_config`;
        # this runtime serves that part. A text config is its own text config.
        self.top_config = hf_config
        text = getattr(hf_config, "get_text_config", None)
        self.hf_config = text() if text is not None else hf_config
        # Block-wise FP8 loads (dequantized on CPU, FP8 linears on CUDA); any other format is refused
        # here, in one sentence naming it, before anything is built.
        self.quant_config = quant_config_of(hf_config)

    @property
    def architecture(self) -> str:
        return self.architectures[0]

    @property
    @abstractmethod
    def layer_types(self) -> list[str]:
        """Per layer: "full_attention", "linear_attention", or (Nemotron-H) "mlp" / "moe"."""

    @property
    def num_hidden_layers(self) -> int:
        return len(self.layer_types)

    @property
    def full_attention_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    def model_layer_of(self, linear_layer_id: int) -> int:
        """The model layer a linear layer id belongs to (itself, except where a layer holds both kinds
        and its mixer takes another id: Falcon-H1)."""
        return linear_layer_id

    @property
    @abstractmethod
    def kernel_state_chunk(self) -> int:
        """Tokens per chunk of the prefill kernel; intermediate states exist at multiples of it."""

    @property
    @abstractmethod
    def state_shape(self) -> Mamba2StateShape: ...

    @property
    def config_ssm_dtype(self) -> str | None:
        """The SSM state dtype the config names (`mamba_ssm_dtype`, as upstream reads it: Qwen3.5's
        configs say float32), or None."""
        return _field(self.hf_config, self.top_config, "mamba_ssm_dtype")

    @property
    def num_attention_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def num_key_value_heads(self) -> int:
        return self.hf_config.num_key_value_heads

    @property
    def kv_heads_per_rank(self) -> int:
        """Key/value heads one TP rank's KV pool holds: its share, or one (replicated) where the TP size
        exceeds their count (`parallel_attention_heads`)."""
        return parallel_attention_heads(self.num_attention_heads, self.num_key_value_heads)[1]

    def kv_head_units(self, tp_size: int, tp_rank: int) -> list[tuple[int, int]]:
        """The key/value heads TP rank `tp_rank` of `tp_size` holds, as [(first, count)]: its share, or
        where the TP size exceeds their count the one head of part `tp_rank * heads // tp_size`
        (`column_shard` with `parts=min(heads, tp)`, as the attention layers build k_proj / v_proj)."""
        heads = self.num_key_value_heads
        per_rank = parallel_attention_heads(self.num_attention_heads, heads, tp_size)[1]
        return [(tp_rank * min(heads, tp_size) // tp_size * per_rank, per_rank)]

    @abstractmethod
    def state_units(self, tp_size: int, tp_rank: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """(conv channels, SSM heads) of a linear layer's state that TP rank `tp_rank` of `tp_size` holds,
        each as [(first, count)] in TP 1's order, listed in the rank's pool order (`disaggregation/
        shard_map.py` moves state between servers of different --tp-size by them). ValueError where the
        model does not split over `tp_size`, as its layers refuse it."""

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return self.hf_config.max_position_embeddings

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        """Bytes of K and V of one token over all full-attention layers (on one TP rank)."""
        per_layer = 2 * self.kv_heads_per_rank * self.head_dim * kv_dtype.itemsize
        return per_layer * len(self.full_attention_layer_ids)

    def mamba2_cache_params(
        self, model_dtype: torch.dtype = torch.float32, ssm_dtype_flag: str | None = None
    ) -> Mamba2CacheParams:
        return Mamba2CacheParams(
            shape=self.state_shape,
            dtype=resolve_state_dtypes(model_dtype, self.config_ssm_dtype, ssm_dtype_flag),
            layers=tuple(self.linear_layer_ids),
        )

    def mamba_cache_per_req(
        self, model_dtype: torch.dtype = torch.float32, ssm_dtype_flag: str | None = None
    ) -> int:
        return self.mamba2_cache_params(model_dtype, ssm_dtype_flag).mamba_cache_per_req


def parallel_attention_heads(num_heads: int, num_kv_heads: int, tp: int | None = None) -> tuple[int, int]:
    """(query heads, key/value heads) of one rank at TP size `tp` (default: this process's group): the
    query heads split; the key/value heads split where there are at least `tp`, else each is held by
    tp / num_kv_heads ranks. ValueError naming --tp-size where neither divides."""
    tp = get_tensor_model_parallel_world_size() if tp is None else tp
    if tp == 1:
        return num_heads, num_kv_heads
    if num_heads % tp:
        raise ValueError(f"--tp-size {tp} does not divide the model's {num_heads} attention heads.")
    if num_kv_heads % tp if num_kv_heads >= tp else tp % num_kv_heads:
        raise ValueError(
            f"--tp-size {tp} and the model's {num_kv_heads} key/value heads: neither divides the other."
        )
    return num_heads // tp, max(1, num_kv_heads // tp)


def _field(first: Any, second: Any, name: str) -> Any:
    """A config field from the first config that states it (text config, then the multimodal one)."""
    return getattr(first, name, None) or getattr(second, name, None)
