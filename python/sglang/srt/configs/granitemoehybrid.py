"""Granite-4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 mixers and full attention (with or without
rotary positions), each followed by a MoE with a shared MLP (or the shared MLP alone)."""

from __future__ import annotations

import math

from sglang.srt.configs.hybrid_arch import HybridArchConfig, register_hybrid_arch
from sglang.srt.configs.mamba_utils import Mamba2StateShape

# The checkpoints' names for the layer kinds (transformers renames them on load; both are accepted).
_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}


@register_hybrid_arch
class GraniteMoeHybridArchConfig(HybridArchConfig):
    architectures = ("GraniteMoeHybridForCausalLM",)
    model_types = ("granitemoehybrid",)
    linear_kind = "mamba2"

    def __init__(self, hf_config):
        super().__init__(hf_config)
        if "linear_attention" not in self.layer_types:
            raise ValueError(
                "This Granite checkpoint has no Mamba layers: it is not a hybrid model, which is what this "
                "runtime serves."
            )
        upper = (getattr(self.hf_config, "time_step_limit", None) or (0.0, math.inf))[1]
        if upper != math.inf:
            raise ValueError(f"A Mamba2 time_step_limit with an upper bound ({upper}) is not supported.")

    @property
    def layer_types(self) -> list[str]:
        cfg = self.hf_config
        types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
        return [_KINDS.get(t, t) for t in types]

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def mamba_head_dim(self) -> int:
        cfg = self.hf_config
        intermediate = int(cfg.mamba_expand * cfg.hidden_size)
        d = cfg.mamba_d_head
        return intermediate // cfg.mamba_n_heads if d in (None, "auto") else int(d)

    @property
    def kernel_state_chunk(self) -> int:
        return int(self.hf_config.mamba_chunk_size)

    @property
    def state_shape(self) -> Mamba2StateShape:
        cfg = self.hf_config
        return Mamba2StateShape.create(
            intermediate_size=cfg.mamba_n_heads * self.mamba_head_dim,
            n_groups=cfg.mamba_n_groups,
            num_heads=cfg.mamba_n_heads,
            head_dim=self.mamba_head_dim,
            state_size=cfg.mamba_d_state,
            conv_kernel=cfg.mamba_d_conv,
        )
