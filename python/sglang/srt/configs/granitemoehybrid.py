"""Granite-4.0-H (`GraniteMoeHybridForCausalLM`): Mamba2 mixers and full attention (with or without
rotary positions), each followed by a MoE with a shared MLP (or the shared MLP alone)."""

from __future__ import annotations

from sglang.srt.configs.bamba_fields import BambaFieldsArchConfig
from sglang.srt.configs.hybrid_arch import register_hybrid_arch

# The checkpoints' names for the layer kinds (transformers renames them on load; both are accepted).
_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}


@register_hybrid_arch
class GraniteMoeHybridArchConfig(BambaFieldsArchConfig):
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

    @property
    def layer_types(self) -> list[str]:
        cfg = self.hf_config
        types = getattr(cfg, "layer_types", None) or getattr(cfg, "layers_block_type", None)
        return [_KINDS.get(t, t) for t in types]
