"""LFM2 (`Lfm2ForCausalLM`): `HybridDecoderLayer`s, each a short conv or full attention (q/k RMSNorm
per head, rotary), then a SwiGLU MLP. The short conv: `B, C, x = in_proj(h)`, `y = C * conv(B * x)` (a
depthwise causal conv without activation, its window the layer's state: `short_conv_backend.py`),
`out_proj(y)`. The checkpoint's `conv` / `self_attn`, `operator_norm`, `ffn_norm`, `feed_forward`
(`w1`, `w3`, `w2`), the attention's `out_proj` / `q_layernorm` / `k_layernorm` and the final
`embedding_norm` are the layer's `mixer`, `input_layernorm`, `post_attention_layernorm`, `mlp`
(`gate_proj`, `up_proj`, `down_proj`), `o_proj` / `q_norm` / `k_norm` and the stack's `norm`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.configs.lfm2 import Lfm2ArchConfig
from sglang.srt.layers.llama_attention import LlamaStyleAttention
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.causal_lm import HybridCausalLM
from sglang.srt.models.hybrid_decoder_layer import HybridDecoderLayer, HybridStack


def ffn_dim(config: Any) -> int:
    """The MLP's width as transformers derives it (`block_auto_adjust_ff_dim`)."""
    size = config.intermediate_size
    if config.block_auto_adjust_ff_dim:
        size = int(2 * size / 3)
        if config.block_ffn_dim_multiplier is not None:
            size = int(config.block_ffn_dim_multiplier * size)
            m = config.block_multiple_of
            size = m * ((size + m - 1) // m)
    return size


class Lfm2ShortConv(nn.Module):
    def __init__(self, config: Any, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        h, bias = config.hidden_size, config.conv_bias
        self.conv = nn.Conv1d(h, h, config.conv_L_cache, groups=h, bias=bias)
        self.in_proj = nn.Linear(h, 3 * h, bias=bias)
        self.out_proj = nn.Linear(h, h, bias=bias)

    def forward(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        B, C, x = self.in_proj(hidden).chunk(3, dim=-1)
        conv = fb.attn_backend.forward_linear(self, fb, B * x)
        return self.out_proj((C.float() * conv).to(hidden.dtype))


def _layer(config: Any, layer_id: int, arch: Lfm2ArchConfig) -> HybridDecoderLayer:
    h, eps = config.hidden_size, config.norm_eps
    if arch.layer_types[layer_id] == "linear_attention":
        mixer: nn.Module = Lfm2ShortConv(config, layer_id)
    else:
        d = arch.head_dim
        mixer = LlamaStyleAttention(
            h, config.num_attention_heads, config.num_key_value_heads, d, layer_id, scale=d**-0.5,
            rope_parameters=getattr(config, "rope_parameters", None) or {}, qk_norm_eps=eps,
        )  # fmt: skip
    return HybridDecoderLayer(mixer, GatedMLP(h, ffn_dim(config), "silu"), h, eps)


class Lfm2ForCausalLM(HybridCausalLM):
    backbone_attr = "model"
    checkpoint_renames = (
        (".self_attn.out_proj.", ".mixer.o_proj."),
        (".self_attn.q_layernorm.", ".mixer.q_norm."),
        (".self_attn.k_layernorm.", ".mixer.k_norm."),
        (".self_attn.", ".mixer."),
        (".conv.", ".mixer."),  # the first one: the layer's; `conv.conv` is the mixer's conv
        (".operator_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
        (".feed_forward.w1.", ".mlp.gate_proj."),
        (".feed_forward.w3.", ".mlp.up_proj."),
        (".feed_forward.w2.", ".mlp.down_proj."),
        ("model.embedding_norm.", "model.norm."),
    )

    def __init__(self, config: Any):
        arch = Lfm2ArchConfig(config)
        layers = [_layer(config, i, arch) for i in range(config.num_hidden_layers)]
        model = HybridStack(config.vocab_size, layers, config.hidden_size, config.norm_eps)
        super().__init__(config, model, model.embed_tokens)
