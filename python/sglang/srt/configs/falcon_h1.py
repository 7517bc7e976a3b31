"""Falcon-H1 (`FalconH1ForCausalLM`): every layer runs a Mamba2 mixer and full attention side by side on
the same normed input (their outputs summed), then an MLP.

A layer is thus both kinds. The pools key layers by id, so the attention of layer i keeps id i and its
Mamba2 mixer takes id `num_hidden_layers + i`: the full-attention and linear id lists stay disjoint, and
every layer has a KV slot and a state slot.
"""

from __future__ import annotations

import math

from sglang.srt.configs.hybrid_arch import HybridArchConfig, register_hybrid_arch
from sglang.srt.configs.mamba_utils import Mamba2StateShape


@register_hybrid_arch
class FalconH1ArchConfig(HybridArchConfig):
    architectures = ("FalconH1ForCausalLM",)
    model_types = ("falcon_h1",)
    linear_kind = "mamba2"

    def __init__(self, hf_config):
        super().__init__(hf_config)
        upper = (getattr(self.hf_config, "time_step_limit", None) or (0.0, math.inf))[1]
        if upper != math.inf:
            raise ValueError(f"A Mamba2 time_step_limit with an upper bound ({upper}) is not supported.")

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
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def mamba_intermediate_size(self) -> int:
        cfg = self.hf_config
        return cfg.mamba_d_ssm if cfg.mamba_d_ssm is not None else int(cfg.mamba_expand * cfg.hidden_size)

    @property
    def mamba_head_dim(self) -> int:
        d = self.hf_config.mamba_d_head
        return self.mamba_intermediate_size // self.hf_config.mamba_n_heads if d in (None, "auto") else int(d)

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
