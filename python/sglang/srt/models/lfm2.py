"""LFM2 (`Lfm2ForCausalLM`): each layer is `x + op(operator_norm(x))`, with `op` a short conv or full
attention (q/k RMSNorm per head, rotary), then `x + SwiGLU(ffn_norm(x))`; the final norm is named
`embedding_norm`. The short conv: `B, C, x = in_proj(h)`, `y = C * conv(B * x)` (a depthwise causal
conv without activation, its window the layer's state: `short_conv_backend.py`), `out_proj(y)`.
Parameter names follow the checkpoint but for the attention's `out_proj` / `q_layernorm` / `k_layernorm`
and the MLP's `w1` / `w3` / `w2` (`o_proj`, `q_norm`, `k_norm`, `gate_proj`, `up_proj`, `down_proj` here)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.configs.lfm2 import Lfm2ArchConfig
from sglang.srt.layers.decode_blocks import AttentionBlock, MLPBlock
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.causal_lm import HybridCausalLM

_RENAMES = (
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".feed_forward.w1.", ".feed_forward.gate_proj."),
    (".feed_forward.w3.", ".feed_forward.up_proj."),
    (".feed_forward.w2.", ".feed_forward.down_proj."),
)


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


class Lfm2Attention(nn.Module):
    def __init__(self, config: Any, layer_id: int, head_dim: int):
        super().__init__()
        h, d = config.hidden_size, head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            d,
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, eps=config.norm_eps)
        self.k_norm = RMSNorm(d, eps=config.norm_eps)
        self.rotary_emb = get_rope(d, getattr(config, "rope_parameters", None) or {})
        self.attn = RadixAttention(self.num_heads, d, d**-0.5, self.num_kv_heads, layer_id)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t = hidden.shape[0]
        q = self.q_norm(self.q_proj(hidden).view(t, self.num_heads, self.head_dim))
        k = self.k_norm(self.k_proj(hidden).view(t, self.num_kv_heads, self.head_dim))
        q, k = self.rotary_emb(positions, q, k, fb.rope_cache)
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), self.v_proj(hidden), fb))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, arch: Lfm2ArchConfig):
        super().__init__()
        self.is_linear = arch.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.conv = Lfm2ShortConv(config, layer_id)
        else:
            self.self_attn = Lfm2Attention(config, layer_id, arch.head_dim)
        self.feed_forward = GatedMLP(config.hidden_size, ffn_dim(config), "silu")
        self.operator_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        # The attention half and the MLP half as one C++ call each (CPU; set at load).
        self.mixer_block: AttentionBlock | None = None
        self.mlp_block: MLPBlock | None = None

    def process_weights_after_loading(self) -> None:
        if not self.is_linear:
            a = self.self_attn
            self.mixer_block = AttentionBlock.build(self.operator_norm, a, (a.q_norm, a.k_norm), a.rotary_emb)
        self.mlp_block = MLPBlock.build(self.ffn_norm, self.feed_forward)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        fused = self.mixer_block(hidden, fb) if self.mixer_block is not None else None
        if fused is None:
            x = self.operator_norm(hidden)
            fused = hidden + (self.conv(x, fb) if self.is_linear else self.self_attn(positions, x, fb))
        hidden = fused
        fused = self.mlp_block(hidden) if self.mlp_block is not None else None
        return fused if fused is not None else hidden + self.feed_forward(self.ffn_norm(hidden))


class Lfm2Model(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        arch = Lfm2ArchConfig(config)
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Lfm2DecoderLayer(config, i, arch) for i in range(config.num_hidden_layers)
        )
        self.embedding_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)  # the final norm

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden = layer(positions, hidden, fb)
        return self.embedding_norm(hidden)


class Lfm2ForCausalLM(HybridCausalLM):
    backbone_attr = "model"

    def __init__(self, config: Any):
        model = Lfm2Model(config)
        super().__init__(config, model, model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        return self.model(input_ids, positions, fb)

    def checkpoint_name(self, name: str) -> str:
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return name
