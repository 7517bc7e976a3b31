"""Nemotron-H: a stack of blocks, each `x + mixer(norm(x))`, where the mixer is a Mamba2 layer, full
attention without positions, a relu2 MLP, or a MoE (sigmoid router with correction bias and group
routing, relu2 experts, a shared expert). Parameter names follow the HF checkpoint (`backbone...`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.configs.nemotron_h import NemotronHArchConfig
from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.layers.decode_blocks import AttentionBlock, Mamba2Block, MLPBlock, MoEBlock
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ReplicatedLinear
from sglang.srt.layers.llama_attention import set_attention_projections
from sglang.srt.layers.mamba2_mixer import Mamba2Mixer
from sglang.srt.layers.mlp import PlainMLP
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.moe.router import grouped_sigmoid_topk
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.stacked_linears import stack_linear_weights, stacked_outputs
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.causal_lm import HybridCausalLM


class NemotronHMamba2Mixer(Mamba2Mixer):
    def __init__(self, config: Any, layer_id: int):
        super().__init__(
            layer_id,
            config.hidden_size,
            num_heads=config.mamba_num_heads,
            head_dim=config.mamba_head_dim,
            n_groups=config.n_groups,
            state_size=config.ssm_state_size,
            conv_kernel=config.conv_kernel,
            conv_bias=config.use_conv_bias,
            proj_bias=config.use_bias,
            eps=config.layer_norm_epsilon,
            time_step_min=config.time_step_min,
        )


class NemotronHAttention(nn.Module):
    def __init__(self, config: Any, layer_id: int):
        super().__init__()
        hidden, heads = config.hidden_size, config.num_attention_heads
        d = getattr(config, "head_dim", None) or hidden // heads
        bias = getattr(config, "attention_bias", False)
        self.num_heads, self.num_kv_heads = set_attention_projections(
            self, hidden, heads, config.num_key_value_heads, d, bias
        )
        self.attn = RadixAttention(self.num_heads, d, d**-0.5, self.num_kv_heads, layer_id)
        self.qkv_stack: torch.Tensor | None = None  # q / k / v as one GEMM (set at load: stacked_linears.py)

    def process_weights_after_loading(self) -> None:
        if self.qkv_stack is None:
            self.qkv_stack = stack_linear_weights([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        q, k, v = stacked_outputs(hidden, (self.q_proj, self.k_proj, self.v_proj), self.qkv_stack)
        return self.o_proj(self.attn(q, k, v, fb))


class NemotronHTopkRouter(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts))
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor
        self.cpu_ops = None  # the C++ top-k: NemotronHMoE sets it where the C++ op serves the experts
        self.triton = False  # the Triton top-k: NemotronHMoE sets it where the experts' Triton path runs

    def groups_hold_top_k(self) -> bool:
        """Whether the grouping can hold top_k experts (the C++ op refuses one that cannot; such a config
        keeps the torch path)."""
        experts = self.weight.shape[0]
        return experts % self.n_group == 0 and self.top_k <= self.topk_group * (experts // self.n_group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())  # (the weight is float32 already: `fp32_param_suffixes`)
        return grouped_sigmoid_topk(
            logits,
            self.top_k,
            self.e_score_correction_bias,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
            self.cpu_ops,
            self.triton,
        )


class NemotronHMoE(nn.Module):
    """Routed experts plus a shared expert. With `moe_latent_size` (Nemotron 3 Super's LatentMoE) the
    routed experts run in a smaller latent space: `fc2_latent_proj(experts(fc1_latent_proj(x)))`, routed
    on x itself; the shared expert stays on x.

    Tensor parallel: the router and the latent projections are replicated, the experts and the shared
    expert split by their intermediate dimension; each rank's partial sum (routed, in latent space taken
    through fc2's weight, plus shared) is all-reduced once, fc2's bias added after."""

    def __init__(self, config: Any):
        super().__init__()
        hidden, act, bias = config.hidden_size, config.mlp_hidden_act, config.mlp_bias
        latent = getattr(config, "moe_latent_size", None)
        self.gate = NemotronHTopkRouter(config)
        self.experts = RoutedExperts(
            config.n_routed_experts, latent or hidden, config.moe_intermediate_size, act, False
        )
        self.shared_experts = PlainMLP(
            hidden, config.moe_shared_expert_intermediate_size, act, bias, reduce_results=False
        )
        self.fc1_latent_proj = ReplicatedLinear(hidden, latent, bias=bias) if latent else None
        self.fc2_latent_proj = ReplicatedLinear(latent, hidden, bias=bias) if latent else None

    def process_weights_after_loading(self) -> None:
        self.experts.process_weights_after_loading()
        self.gate.cpu_ops = self.experts.cpu_ops if self.gate.groups_hold_top_k() else None
        self.gate.triton = self.experts.triton and self.gate.groups_hold_top_k()
        if self.fc1_latent_proj is None:  # the op's shared expert reads the experts' input
            self.experts.fuse_shared_expert(self.shared_experts)

    def fused_block(self, norm: RMSNorm) -> MoEBlock | None:
        """`hidden + self(norm(hidden))` as one C++ call, where that applies (`decode_blocks.py`; not with
        the latent projections)."""
        if self.fc1_latent_proj is not None:
            return None
        g = self.gate
        routing = (g.e_score_correction_bias, g.top_k, g.norm_topk_prob, g.n_group, g.topk_group)
        routing += (float(g.routed_scaling_factor),)
        return MoEBlock.build(norm, self.experts, g.weight, g.cpu_ops, (self.shared_experts, None), routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        if self.fc1_latent_proj is None:
            return tensor_model_parallel_all_reduce(self.experts(x, weights, ids, self.shared_experts))
        fc2 = self.fc2_latent_proj
        routed = F.linear(self.experts(self.fc1_latent_proj(x), weights, ids), fc2.weight)
        out = tensor_model_parallel_all_reduce(routed + self.shared_experts(x))
        return out if fc2.bias is None else out + fc2.bias


class NemotronHBlock(nn.Module):
    def __init__(self, config: Any, layer_id: int, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        if kind == "linear_attention":
            self.mixer = NemotronHMamba2Mixer(config, layer_id)
        elif kind == "full_attention":
            self.mixer = NemotronHAttention(config, layer_id)
        elif kind == "moe":
            self.mixer = NemotronHMoE(config)
        elif kind == "mlp":
            self.mixer = PlainMLP(
                config.hidden_size, config.intermediate_size, config.mlp_hidden_act, config.mlp_bias
            )
        else:
            raise ValueError(f"Unknown Nemotron-H block type {kind!r} at layer {layer_id}.")
        # The block as one C++ call (CPU; set at load).
        self.fused: Mamba2Block | AttentionBlock | MoEBlock | MLPBlock | None = None

    def process_weights_after_loading(self) -> None:
        """After the children's (`load_model` runs them first): the fused CPU block where it applies."""
        if self.kind == "linear_attention":
            self.fused = Mamba2Block.build(self.norm, self.mixer)
        elif self.kind == "full_attention":
            self.fused = AttentionBlock.build(self.norm, self.mixer)
        elif self.kind == "moe":
            self.fused = self.mixer.fused_block(self.norm)
        else:
            self.fused = MLPBlock.build(self.norm, self.mixer)

    def forward(
        self, hidden: torch.Tensor, fb: ForwardBatch, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The block on `hidden + residual` (residual None: `hidden` alone); returns (out, residual), whose
        sum is the block's output: the residual add is deferred into the next block's norm
        (`RMSNorm.add_and_norm`, one kernel on CUDA); the CPU decode block takes and gives whole states."""
        if self.fused is not None:
            if residual is not None:
                hidden, residual = hidden + residual, None
            out = self.fused(hidden, fb)
            if out is not None:
                return out, None
        x, residual = self.norm.add_and_norm(hidden, residual)
        x = self.mixer(x, fb) if self.kind in ("linear_attention", "full_attention") else self.mixer(x)
        return x, residual


class NemotronHModel(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        kinds = NemotronHArchConfig(config).layer_types
        self.embeddings = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(NemotronHBlock(config, i, kind) for i, kind in enumerate(kinds))
        self.norm_f = RMSNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embeddings(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(hidden, fb, residual)
        return self.norm_f.add_and_norm(hidden, residual)[0]


class NemotronHForCausalLM(HybridCausalLM):
    backbone_attr = "backbone"
    # The router's weight too: its logits are float32 (as transformers computes them), and a 16-bit copy
    # would be cast on every forward (a launch and the [experts, hidden] float32 copy per MoE layer).
    fp32_param_suffixes = ("A_log", "dt_bias", ".D", "e_score_correction_bias", ".mixer.gate.weight")

    def __init__(self, config: Any):
        backbone = NemotronHModel(config)
        super().__init__(config, backbone, backbone.embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """Final hidden states [T, hidden]; attention here uses no positions."""
        return self.backbone(input_ids, fb)

    def checkpoint_name(self, name: str) -> str:
        # transformers' in-memory names use `model.`; checkpoints use `backbone.`.
        if name.startswith("model."):
            name = "backbone." + name[len("model.") :]
        return name.replace(".experts.up_proj", ".experts.w13").replace(".experts.down_proj", ".experts.w2")
