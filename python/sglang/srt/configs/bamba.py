"""Bamba (`BambaForCausalLM`): Mamba2 mixers, and full attention (rotary over half of each head) at
`attn_layer_indices`, each followed by a gated MLP."""

from __future__ import annotations

from sglang.srt.configs.bamba_fields import BambaFieldsArchConfig
from sglang.srt.configs.hybrid_arch import register_hybrid_arch


@register_hybrid_arch
class BambaArchConfig(BambaFieldsArchConfig):
    architectures = ("BambaForCausalLM",)
    model_types = ("bamba",)
    linear_kind = "mamba2"

    @property
    def layer_types(self) -> list[str]:
        cfg = self.hf_config
        attention = set(cfg.attn_layer_indices or [])
        return [
            "full_attention" if i in attention else "linear_attention" for i in range(cfg.num_hidden_layers)
        ]
