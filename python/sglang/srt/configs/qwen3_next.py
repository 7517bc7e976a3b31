"""Qwen3-Next (Gated DeltaNet + gated full attention, MoE with a shared expert)."""

from __future__ import annotations

from sglang.srt.configs.hybrid_arch import HybridArchConfig, register_hybrid_arch
from sglang.srt.configs.mamba_utils import Mamba2StateShape

# The chunked gated-delta-rule kernel (FLA and ours) materialises states every 64 tokens.
GDN_KERNEL_CHUNK = 64


@register_hybrid_arch
class Qwen3NextArchConfig(HybridArchConfig):
    architectures = ("Qwen3NextForCausalLM",)
    model_types = ("qwen3_next",)
    linear_kind = "gdn"

    @property
    def layer_types(self) -> list[str]:
        cfg = self.hf_config
        types = getattr(cfg, "layer_types", None)
        if types:
            return list(types)
        # Checkpoints written for SGLang may state only the interval: layer l is full attention
        # iff (l + 1) % interval == 0.
        interval = getattr(cfg, "full_attention_interval", 4)
        return [
            "full_attention" if (i + 1) % interval == 0 else "linear_attention"
            for i in range(cfg.num_hidden_layers)
        ]

    @property
    def kernel_state_chunk(self) -> int:
        return GDN_KERNEL_CHUNK

    @property
    def state_shape(self) -> Mamba2StateShape:
        cfg = self.hf_config
        return Mamba2StateShape.create(
            intermediate_size=cfg.linear_value_head_dim * cfg.linear_num_value_heads,
            n_groups=cfg.linear_num_key_heads,
            num_heads=cfg.linear_num_value_heads,
            head_dim=cfg.linear_value_head_dim,
            state_size=cfg.linear_key_head_dim,
            conv_kernel=cfg.linear_conv_kernel_dim,
        )

    def state_units(self, tp_size: int, tp_rank: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Rank r's part of each of the conv's q | k | v sub-blocks (`Qwen3NextGatedDeltaNet`'s conv
        shard) and its value heads. The key heads must split, as the layer requires."""
        cfg = self.hf_config
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if hk % tp_size or hv % tp_size:
            raise ValueError(
                f"--tp-size {tp_size} does not divide the model's {hk} linear-attention key heads and "
                f"{hv} value heads."
            )
        kd, vd = hk * cfg.linear_key_head_dim // tp_size, hv * cfg.linear_value_head_dim // tp_size
        conv = [(tp_rank * kd, kd), (tp_size * kd + tp_rank * kd, kd), (2 * tp_size * kd + tp_rank * vd, vd)]
        return conv, [(tp_rank * hv // tp_size, hv // tp_size)]
