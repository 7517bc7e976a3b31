"""Nemotron-H (Mamba2 mixers, full attention without positions, MLP and MoE blocks)."""

from __future__ import annotations

from sglang.srt.configs.bamba_fields import mamba2_rank_state_shape, mamba2_state_units
from sglang.srt.configs.hybrid_arch import HybridArchConfig, register_hybrid_arch
from sglang.srt.configs.mamba_utils import Mamba2StateShape

_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


@register_hybrid_arch
class NemotronHArchConfig(HybridArchConfig):
    architectures = ("NemotronHForCausalLM",)
    model_types = ("nemotron_h",)
    linear_kind = "mamba2"

    @property
    def layer_types(self) -> list[str]:
        cfg = self.hf_config
        types = getattr(cfg, "layers_block_type", None)
        if types:
            return list(types)
        return [_PATTERN[c] for c in cfg.hybrid_override_pattern]

    @property
    def mamba_layer_ids(self) -> list[int]:
        return self.linear_layer_ids

    @property
    def kernel_state_chunk(self) -> int:
        # transformers writes `chunk_size`; some checkpoints (and SGLang) use `mamba_chunk_size`.
        cfg = self.hf_config
        chunk = getattr(cfg, "mamba_chunk_size", None) or getattr(cfg, "chunk_size", None)
        if not chunk:
            raise ValueError("The Nemotron-H config states neither chunk_size nor mamba_chunk_size.")
        return int(chunk)

    @property
    def state_shape(self) -> Mamba2StateShape:
        """This TP rank's (`mamba2_rank_state_shape`)."""
        cfg = self.hf_config
        return mamba2_rank_state_shape(
            cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size, cfg.conv_kernel
        )

    def state_units(self, tp_size: int, tp_rank: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        cfg = self.hf_config
        return mamba2_state_units(
            cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size, tp_size, tp_rank
        )

    @property
    def config_ssm_dtype(self) -> str | None:
        return getattr(self.hf_config, "mamba_ssm_cache_dtype", None) or super().config_ssm_dtype
