"""Granite-4.0-H (`GraniteMoeHybridForCausalLM`): each layer is `x + m * mixer(norm(x))` with a Mamba2
mixer or full attention (rotary or no positions, the config's attention scale), then
`x + m * (MoE(norm(x)) + shared_mlp(norm(x)))` (the shared MLP alone where there are no experts); the
embedding is scaled by `embedding_multiplier` and the logits divided by `logits_scaling`.

The scales are folded into the weights as they load, so the layers are the plain residual blocks every
fused path knows: the residual multiplier `m` into each branch's last projection (`o_proj`, the Mamba
`out_proj`, the experts' and the shared MLP's output projections), and `1 / logits_scaling` into the
final norm's weight (the LM head is linear, and may be tied to the embedding, which stays as it is).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.configs.granitemoehybrid import GraniteMoeHybridArchConfig
from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.layers.decode_blocks import MoEBlock
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.llama_attention import LlamaStyleAttention
from sglang.srt.layers.mamba2_mixer import Mamba2Mixer
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.moe.router import softmax_topk
from sglang.srt.models.causal_lm import HybridCausalLM
from sglang.srt.models.hybrid_decoder_layer import HybridDecoderLayer, HybridStack

# Checkpoint name pieces -> ours (`HybridDecoderLayer`'s mixer; the MoE's router and experts; the shared
# MLP lives in our MoE module).
_RENAMES = (
    (".mamba.", ".mixer."),
    (".self_attn.", ".mixer."),
    (".block_sparse_moe.router.layer.", ".mlp.gate."),
    (".block_sparse_moe.input_linear.weight", ".mlp.experts.w13"),
    (".block_sparse_moe.output_linear.weight", ".mlp.experts.w2"),
)
# Tensors that end a residual branch: scaled by the residual multiplier as they load.
_BRANCH_ENDS = (".o_proj.weight", ".o_proj.bias", ".mixer.out_proj.weight", ".mixer.out_proj.bias")
_BRANCH_ENDS += (".mlp.experts.w2", ".down_proj.weight")


class GraniteMoeHybridMoE(nn.Module):
    """Softmax over the top k router logits (= softmax over all, renormalised over the top k), the
    routed experts, plus the shared MLP (run inside the experts' C++ op where that applies). Tensor
    parallel: the router replicated, the experts and the shared MLP split by their intermediate
    dimension, their partial sums all-reduced once."""

    def __init__(self, config: Any):
        super().__init__()
        hidden, act = config.hidden_size, config.hidden_act
        self.top_k = config.num_experts_per_tok
        self.gate = ReplicatedLinear(hidden, config.num_local_experts, bias=False)
        self.experts = RoutedExperts(config.num_local_experts, hidden, config.intermediate_size, act, True)
        self.shared_mlp = GatedMLP(hidden, config.shared_intermediate_size, act, reduce_results=False)
        self.routing_ops = None  # the C++ top-k where the C++ op serves the experts (set at load)

    def process_weights_after_loading(self) -> None:
        self.experts.process_weights_after_loading()
        self.routing_ops = self.experts.cpu_ops
        self.experts.fuse_shared_expert(self.shared_mlp)

    def fused_block(self, norm: RMSNorm) -> MoEBlock | None:
        routing = (None, self.top_k, True, 1, 1, 1.0)
        return MoEBlock.build(
            norm, self.experts, self.gate.weight, self.routing_ops, (self.shared_mlp, None), routing
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = softmax_topk(self.gate(x), self.top_k, True, self.routing_ops, self.experts.triton)
        return tensor_model_parallel_all_reduce(self.experts(x, weights, ids, self.shared_mlp, None))


def _layer(config: Any, layer_id: int, arch: GraniteMoeHybridArchConfig) -> HybridDecoderLayer:
    hidden = config.hidden_size
    if arch.layer_types[layer_id] == "linear_attention":
        mixer: nn.Module = Mamba2Mixer(layer_id, hidden, **arch.mamba_mixer_args())
    else:
        rope = getattr(config, "position_embedding_type", None) == "rope"  # Granite-4.0-H's: "nope"
        mixer = LlamaStyleAttention(
            hidden, config.num_attention_heads, config.num_key_value_heads, arch.head_dim, layer_id,
            scale=float(config.attention_multiplier), bias=config.attention_bias,
            rope_parameters=(getattr(config, "rope_parameters", None) or {}) if rope else None,
        )  # fmt: skip
    if (getattr(config, "num_local_experts", 0) or 0) > 0:
        mlp: nn.Module = GraniteMoeHybridMoE(config)
    else:
        mlp = GatedMLP(hidden, config.shared_intermediate_size, config.hidden_act)
    return HybridDecoderLayer(mixer, mlp, hidden, config.rms_norm_eps)


class GraniteMoeHybridForCausalLM(HybridCausalLM):
    backbone_attr = "model"
    fp32_param_suffixes = ("A_log", "dt_bias", ".D")
    checkpoint_renames = _RENAMES

    def __init__(self, config: Any):
        arch = GraniteMoeHybridArchConfig(config)
        layers = [_layer(config, i, arch) for i in range(config.num_hidden_layers)]
        model = HybridStack(
            config.vocab_size,
            layers,
            config.hidden_size,
            config.rms_norm_eps,
            float(config.embedding_multiplier),
        )
        super().__init__(config, model, model.embed_tokens)
        self.residual_multiplier = float(config.residual_multiplier)
        self.logits_scaling = float(config.logits_scaling)

    def checkpoint_name(self, name: str) -> str:
        name = super().checkpoint_name(name)
        if ".shared_mlp.output_linear." in name:
            name = name.replace(".shared_mlp.output_linear.", self._shared_mlp_prefix(name) + "down_proj.")
        return name

    def checkpoint_tensors(self, name: str, tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The shared MLP's [gate | up] rows as its two projections."""
        if ".shared_mlp.input_linear." in name:
            prefix = name[: name.index(".shared_mlp.")] + self._shared_mlp_prefix(name)
            suffix = name.rsplit(".", 1)[1]
            gate, up = tensor.chunk(2, dim=0)
            return [(f"{prefix}gate_proj.{suffix}", gate), (f"{prefix}up_proj.{suffix}", up)]
        return [(self.checkpoint_name(name), tensor)]

    def folded_scale(self, name: str) -> float | None:
        if name.endswith(_BRANCH_ENDS):
            return self.residual_multiplier
        return 1.0 / self.logits_scaling if name == "model.norm.weight" else None

    def _shared_mlp_prefix(self, name: str) -> str:
        """Where a layer's shared MLP lives here: inside the MoE module, or the layer's whole MLP."""
        layer = int(name.split(".")[2])
        return (
            ".mlp.shared_mlp." if isinstance(self.model.layers[layer].mlp, GraniteMoeHybridMoE) else ".mlp."
        )
