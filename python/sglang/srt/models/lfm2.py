"""LFM2 (`Lfm2ForCausalLM`) and LFM2-MoE (`Lfm2MoeForCausalLM`): `HybridDecoderLayer`s, each a short
conv or full attention (q/k RMSNorm per head, rotary), then a SwiGLU MLP (LFM2-MoE: a MoE after its first
`num_dense_layers`: sigmoid scores, experts chosen by score + `expert_bias`, weighted by the score,
renormalised and scaled). The short conv: `B, C, x = in_proj(h)`, `y = C * conv(B * x)` (a
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
from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.layers.linear import (
    MergedColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    column_shard,
    set_weight_shards,
)
from sglang.srt.layers.llama_attention import LlamaStyleAttention
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.moe.router import grouped_sigmoid_topk
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
    """Tensor parallel: the channels split over the ranks (each of in_proj's B | C | x pieces on its own,
    the conv's channels and state alike), out_proj row-parallel."""

    def __init__(self, config: Any, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        h, bias = config.hidden_size, config.conv_bias
        what = "LFM2's short-conv channels (hidden_size)"
        self.in_proj = MergedColumnParallelLinear(h, [h, h, h], bias=bias, what=what)
        local = self.in_proj.out_features // 3
        self.conv = nn.Conv1d(local, local, config.conv_L_cache, groups=local, bias=bias)
        channels = column_shard(0, [h], what=what)
        set_weight_shards(self.conv.weight, channels)
        if self.conv.bias is not None:
            set_weight_shards(self.conv.bias, channels)
        self.out_proj = RowParallelLinear(h, h, bias=bias, what=what)

    def forward(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        B, C, x = self.in_proj(hidden).chunk(3, dim=-1)
        conv = fb.attn_backend.forward_linear(self, fb, B * x)
        return self.out_proj((C.float() * conv).to(hidden.dtype))


class Lfm2MoeBlock(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        h, n = config.hidden_size, config.num_experts
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.scaling = float(config.routed_scaling_factor)
        self.gate = ReplicatedLinear(h, n, bias=False)  # tensor parallel: experts split, router not
        if config.use_expert_bias:
            self.expert_bias = nn.Parameter(torch.zeros(n))
        else:  # built on the host: the model is built under the meta device
            self.register_buffer("expert_bias", torch.zeros(n, device="cpu"), persistent=False)
        self.experts = RoutedExperts(n, h, config.moe_intermediate_size, "silu", True)
        self.routing_ops = None  # the C++ top-k where the C++ op serves the experts (set at load)

    def process_weights_after_loading(self) -> None:
        self.experts.process_weights_after_loading()
        self.routing_ops = self.experts.cpu_ops

    def fused_block(self, norm: nn.Module) -> None:
        """No whole-block C++ call (the decode block op carries a shared expert, which LFM2-MoE has
        not); the experts and the routing still run their C++ ops."""
        return None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # transformers adds 1e-6 to the renormalising sum, the router here 1e-20: ~5e-7 relative (a
        # top-k of sigmoids sums to ~1 or more), far below the oracle tolerance.
        weights, ids = grouped_sigmoid_topk(
            self.gate(x), self.top_k, self.expert_bias, 1, 1, self.renormalize, self.scaling, self.routing_ops
        )
        return tensor_model_parallel_all_reduce(self.experts(x, weights, ids))


def _layer(config: Any, layer_id: int, arch: Lfm2ArchConfig) -> HybridDecoderLayer:
    h, eps = config.hidden_size, config.norm_eps
    if arch.layer_types[layer_id] == "linear_attention":
        mixer: nn.Module = Lfm2ShortConv(config, layer_id)
    else:
        d = arch.head_dim
        mixer = LlamaStyleAttention(
            h, config.num_attention_heads, config.num_key_value_heads, d, layer_id,
            rope_parameters=getattr(config, "rope_parameters", None) or {}, qk_norm_eps=eps,
        )  # fmt: skip
    if getattr(config, "num_experts", None) is None:  # LFM2
        mlp: nn.Module = GatedMLP(h, ffn_dim(config), "silu")
    elif layer_id < config.num_dense_layers:  # LFM2-MoE's first layers: the width as given
        mlp = GatedMLP(h, config.intermediate_size, "silu")
    else:
        mlp = Lfm2MoeBlock(config)
    return HybridDecoderLayer(mixer, mlp, h, eps)


class Lfm2ForCausalLM(HybridCausalLM):
    backbone_attr = "model"
    fp32_param_suffixes = ("expert_bias",)
    checkpoint_renames = (
        (".self_attn.out_proj.", ".mixer.o_proj."),
        (".self_attn.q_layernorm.", ".mixer.q_norm."),
        (".self_attn.k_layernorm.", ".mixer.k_norm."),
        (".self_attn.", ".mixer."),
        (".conv.", ".mixer."),  # the first one: the layer's; `conv.conv` is the mixer's conv
        (".operator_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
        (".feed_forward.", ".mlp."),
        # The MLP's and each expert's (LFM2-MoE's published per-expert `experts.N.w1`, ...) projections.
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
        # transformers' fused experts (what it saves).
        (".experts.gate_up_proj", ".experts.w13"),
        (".experts.down_proj", ".experts.w2"),
        ("model.embedding_norm.", "model.norm."),
    )

    def __init__(self, config: Any):
        arch = Lfm2ArchConfig(config)
        layers = [_layer(config, i, arch) for i in range(config.num_hidden_layers)]
        model = HybridStack(config.vocab_size, layers, config.hidden_size, config.norm_eps)
        super().__init__(config, model, model.embed_tokens)
