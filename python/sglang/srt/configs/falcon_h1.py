"""Falcon-H1 (`FalconH1ForCausalLM`): every layer runs a Mamba2 mixer and full attention side by side on
the same normed input (their outputs summed), then an MLP.

A layer is thus both kinds. The pools key layers by id, so the attention of layer i keeps id i and its
Mamba2 mixer takes id `num_hidden_layers + i`: the full-attention and linear id lists stay disjoint, and
every layer has a KV slot and a state slot.
"""

from __future__ import annotations

from sglang.srt.configs.bamba_fields import BambaFieldsArchConfig
from sglang.srt.configs.hybrid_arch import register_hybrid_arch


@register_hybrid_arch
class FalconH1ArchConfig(BambaFieldsArchConfig):
    architectures = ("FalconH1ForCausalLM",)
    model_types = ("falcon_h1",)
    linear_kind = "mamba2"

    @property
    def layer_types(self) -> list[str]:
        return ["parallel_hybrid"] * self.hf_config.num_hidden_layers

    @property
    def full_attention_layer_ids(self) -> list[int]:
        return list(range(self.num_hidden_layers))

    @property
    def linear_layer_ids(self) -> list[int]:
        """The Mamba2 mixers' ids: layer i's is `num_hidden_layers + i`."""
        n = self.num_hidden_layers
        return list(range(n, 2 * n))

    def model_layer_of(self, linear_layer_id: int) -> int:
        return linear_layer_id - self.num_hidden_layers

    @property
    def mamba_intermediate_size(self) -> int:
        """`mamba_d_ssm` where the config sets it."""
        cfg = self.hf_config
        return cfg.mamba_d_ssm if cfg.mamba_d_ssm is not None else super().mamba_intermediate_size
