"""LFM2 (`Lfm2ForCausalLM`): short-conv layers (a gated depthwise conv whose state is its last K-1
inputs: `conv_L_cache - 1` columns) and full attention at the config's `layer_types` ("conv" /
"full_attention"), each followed by a SwiGLU MLP."""

from __future__ import annotations

from sglang.srt.configs.hybrid_arch import HybridArchConfig, register_hybrid_arch
from sglang.srt.configs.mamba_utils import Mamba2StateShape

# Every position has a conv state, so any chunk serves; GDN's keeps the cache lattice of the tests.
SHORT_CONV_STATE_CHUNK = 64


@register_hybrid_arch
class Lfm2ArchConfig(HybridArchConfig):
    architectures = ("Lfm2ForCausalLM",)
    model_types = ("lfm2",)
    linear_kind = "short_conv"

    @property
    def layer_types(self) -> list[str]:
        cfg = self.hf_config
        types = getattr(cfg, "layer_types", None)
        if not types:
            attention = set(cfg.full_attn_idxs or [])
            types = ["full_attention" if i in attention else "conv" for i in range(cfg.num_hidden_layers)]
        return ["linear_attention" if t == "conv" else t for t in types]

    @property
    def head_dim(self) -> int:
        cfg = self.hf_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def kernel_state_chunk(self) -> int:
        return SHORT_CONV_STATE_CHUNK

    @property
    def state_shape(self) -> Mamba2StateShape:
        """The conv window (hidden_size channels); the SSM part is a 1-element row nothing reads, so
        that every pool operation (copies, snapshots, transfers) stays the Mamba2 one."""
        cfg = self.hf_config
        return Mamba2StateShape.create(
            intermediate_size=cfg.hidden_size,
            n_groups=0,
            num_heads=1,
            head_dim=1,
            state_size=1,
            conv_kernel=cfg.conv_L_cache,
        )
