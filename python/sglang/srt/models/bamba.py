"""Bamba (`BambaForCausalLM`): `HybridDecoderLayer`s, each a Mamba2 mixer or a Llama-style attention
(rotary over half of each head: transformers fixes `partial_rotary_factor` at 0.5 for Bamba), then a
gated MLP. The checkpoint's `mamba` / `self_attn`, `feed_forward`, `pre_ff_layernorm` and
`final_layernorm` are the layer's `mixer`, `mlp`, `post_attention_layernorm` and the stack's `norm`."""

from __future__ import annotations

from typing import Any

from torch import nn

from sglang.srt.configs.bamba import BambaArchConfig
from sglang.srt.layers.llama_attention import LlamaStyleAttention
from sglang.srt.layers.mamba2_mixer import Mamba2Mixer
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.models.causal_lm import HybridCausalLM
from sglang.srt.models.hybrid_decoder_layer import HybridDecoderLayer, HybridStack


def _layer(config: Any, layer_id: int, arch: BambaArchConfig) -> HybridDecoderLayer:
    hidden = config.hidden_size
    if arch.layer_types[layer_id] == "linear_attention":
        mixer: nn.Module = Mamba2Mixer(layer_id, hidden, **arch.mamba_mixer_args())
    else:
        d = arch.head_dim
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope.setdefault("partial_rotary_factor", 0.5)  # transformers' fixed value for Bamba
        mixer = LlamaStyleAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, d, layer_id,
            rope_parameters=rope, bias=getattr(config, "attention_bias", False),
        )  # fmt: skip
    mlp = GatedMLP(hidden, config.intermediate_size, config.hidden_act, getattr(config, "mlp_bias", False))
    return HybridDecoderLayer(mixer, mlp, hidden, config.rms_norm_eps)


class BambaForCausalLM(HybridCausalLM):
    backbone_attr = "model"
    fp32_param_suffixes = ("A_log", "dt_bias", ".D")
    checkpoint_renames = (
        (".mamba.", ".mixer."),
        (".self_attn.", ".mixer."),
        (".feed_forward.", ".mlp."),
        (".pre_ff_layernorm.", ".post_attention_layernorm."),
        ("model.final_layernorm.", "model.norm."),
    )

    def __init__(self, config: Any):
        arch = BambaArchConfig(config)
        layers = [_layer(config, i, arch) for i in range(config.num_hidden_layers)]
        model = HybridStack(config.vocab_size, layers, config.hidden_size, config.rms_norm_eps)
        super().__init__(config, model, model.embed_tokens)
