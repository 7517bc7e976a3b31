"""Qwen3-Next: Gated DeltaNet layers and gated full attention (partial rotary, q/k norms, an output gate),
each followed by a sparse MoE with a sigmoid-gated shared expert (or a dense MLP). Parameter names
follow the HF checkpoint (`model.layers.N...`)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.configs.hybrid_arch import parallel_attention_heads
from sglang.srt.distributed import get_tensor_model_parallel_world_size, tensor_model_parallel_all_reduce
from sglang.srt.environ import envs
from sglang.srt.layers.cpu_ops import cpu_linear_ops
from sglang.srt.layers.decode_blocks import AttentionBlock, GdnBlock, MLPBlock, MoEBlock
from sglang.srt.layers.gpu_ops import triton_chosen
from sglang.srt.layers.layernorm import GatedRMSNorm, RMSNorm
from sglang.srt.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    column_shard,
    full_shape,
    set_weight_shards,
)
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.moe.router import softmax_topk
from sglang.srt.layers.moe.shared_routing import SharedRouting
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.stacked_linears import stack_linear_weights, stacked_outputs
from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.models.causal_lm import HybridCausalLM


def group_rows_by_piece(weight: torch.Tensor, heads: int, sizes: list[int]) -> torch.Tensor:
    """Rows laid out per head as [piece 0 | piece 1 | ...] regrouped as [piece 0 of every head | piece 1 of
    every head | ...] (Qwen3-Next's input projections; `Qwen3NextGatedDeltaNet.process_weights_after_loading`)."""
    pieces = weight.view(heads, sum(sizes), weight.shape[1]).split(sizes, dim=1)
    return torch.cat([p.reshape(-1, weight.shape[1]) for p in pieces])


class Qwen3NextGatedDeltaNet(nn.Module):
    """Tensor parallel: each rank holds num_k_heads / tp key heads with their value heads (the key heads
    must split: --tp-size divides linear_num_key_heads). Its input projections' rows, its conv's channels
    (q | k | v, each sub-block split on its own, as its conv state) and its A_log / dt_bias are its heads';
    out_proj is row-parallel; the gated norm is per head. Head counts below are this rank's."""

    # The checkpoint stores the input projections per key head (regrouped after loading); Qwen3.5's not.
    checkpoint_per_key_head = True

    def __init__(self, config: Any, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        tp = get_tensor_model_parallel_world_size()
        self.total_k_heads = config.linear_num_key_heads
        if self.total_k_heads % tp:
            raise ValueError(
                f"--tp-size {tp} does not divide the model's {self.total_k_heads} linear-attention key heads "
                "(linear_num_key_heads), which tensor parallelism splits."
            )
        self.num_k_heads = self.total_k_heads // tp
        self.num_v_heads = config.linear_num_value_heads // tp
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        key_dim = config.linear_num_key_heads * self.head_k_dim
        value_dim = config.linear_num_value_heads * self.head_v_dim
        hidden = config.hidden_size
        conv_shard = column_shard(0, [key_dim, key_dim, value_dim])
        conv_dim = conv_shard.local_size
        self.conv1d = nn.Conv1d(
            conv_dim, conv_dim, config.linear_conv_kernel_dim, groups=conv_dim, bias=False
        )
        set_weight_shards(self.conv1d.weight, conv_shard)
        # Split by key heads, in the checkpoint's layout (per key head, or Qwen3.5's by piece).
        self.in_proj_qkvz = ColumnParallelLinear(
            hidden, 2 * key_dim + 2 * value_dim, output_sizes=self.qkvz_sizes()
        )
        self.in_proj_ba = ColumnParallelLinear(
            hidden, 2 * config.linear_num_value_heads, output_sizes=self.ba_sizes()
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        for param in (self.dt_bias, self.A_log):
            set_weight_shards(param, column_shard(0, [config.linear_num_value_heads]))
        self.norm = GatedRMSNorm(self.head_v_dim, eps=config.rms_norm_eps)
        self.out_proj = RowParallelLinear(value_dim, hidden)

        # The checkpoint lays the projections out per key head; `process_weights_after_loading` regroups them.
        self.projections_grouped = False
        self.cpu_ops = None
        # Both input projections' weights as one GEMM's (`stacked_linears.py`: one launch per layer less at
        # decode), set at load where both are plain linears.
        self.in_proj_stack: torch.Tensor | None = None

    def qkvz_sizes(self, grouped: bool | None = None) -> list[int]:
        """The pieces of in_proj_qkvz's full rows that split apart: one block (per key head: a rank's
        key heads are consecutive rows) or [q | k | v | z] over all heads (grouped)."""
        tp = get_tensor_model_parallel_world_size()
        hk, hv = self.num_k_heads * tp, self.num_v_heads * tp
        kd, vd = hk * self.head_k_dim, hv * self.head_v_dim
        grouped = not self.checkpoint_per_key_head if grouped is None else grouped
        return [kd, kd, vd, vd] if grouped else [2 * kd + 2 * vd]

    def ba_sizes(self, grouped: bool | None = None) -> list[int]:
        hv = self.num_v_heads * get_tensor_model_parallel_world_size()
        grouped = not self.checkpoint_per_key_head if grouped is None else grouped
        return [hv, hv] if grouped else [2 * hv]

    def process_weights_after_loading(self) -> None:
        """Reorder the rows of the input projections from the checkpoint's per-key-head layout, [q | k | v of
        its value heads | z of them] and [b | a of its value heads] for each key head, to [q | k | v | z] and
        [b | a] over all heads: the outputs then split by slicing, where the per-head layout takes ~10 ops
        per layer (views, splits, reshapes, a concatenation) every forward. Same products, same values.
        Once only: the rows are regrouped in place of the checkpoint's."""
        # On CPU the backend computes the gates with one sgl-kernel call (`gdn_gates`), not ~7 small ops.
        self.cpu_ops = cpu_linear_ops(self.A_log.device)
        if not self.projections_grouped:
            for proj, sizes in self.projection_pieces().items():
                proj.weight.data = group_rows_by_piece(proj.weight.data, self.num_k_heads, sizes)
            # This rank's rows are its heads' in the grouped layout now: so the rule says (gathers, updates).
            set_weight_shards(self.in_proj_qkvz.weight, column_shard(0, self.qkvz_sizes(grouped=True)))
            set_weight_shards(self.in_proj_ba.weight, column_shard(0, self.ba_sizes(grouped=True)))
            self.projections_grouped = True
        if self.in_proj_stack is None:
            self.in_proj_stack = stack_linear_weights([self.in_proj_qkvz, self.in_proj_ba])

    def _projections(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(in_proj_qkvz(hidden), in_proj_ba(hidden)): one GEMM on the stack where it serves."""
        return stacked_outputs(hidden, (self.in_proj_qkvz, self.in_proj_ba), self.in_proj_stack)

    def served_projection(self, proj: nn.Linear, weight: torch.Tensor) -> torch.Tensor:
        """A (whole) checkpoint `weight` of the input projection `proj` in the rows' order it is served in
        (regrouped over all heads, once the projections are: a weight update's)."""
        served_differently = self.projections_grouped and self.checkpoint_per_key_head
        if not served_differently or tuple(weight.shape) != full_shape(proj.weight):
            return weight  # (one of another shape: the loader refuses it, naming it)
        return group_rows_by_piece(weight, self.total_k_heads, self.projection_pieces()[proj])

    def projection_pieces(self) -> dict[nn.Linear, list[int]]:
        """Each input projection with the sizes of its pieces within one key head's rows."""
        dk, dv, r = self.head_k_dim, self.head_v_dim, self.num_v_heads // self.num_k_heads
        return {self.in_proj_qkvz: [dk, dk, r * dv, r * dv], self.in_proj_ba: [r, r]}

    def _split_projections(self, qkvz: torch.Tensor, ba: torch.Tensor, contiguous: bool = True):
        """(mixed q|k|v, z [T, Hv, Dv], b, a) from the projections' outputs. Without `contiguous` (a
        decode step: its conv kernel reads strided rows) mixed q|k|v may be a column slice."""
        t = qkvz.shape[0]
        hk, dk, dv = self.num_k_heads, self.head_k_dim, self.head_v_dim
        if self.projections_grouped:
            qkv_dim = 2 * hk * dk + self.num_v_heads * dv
            z = qkvz[:, qkv_dim:].reshape(t, self.num_v_heads, dv)
            mixed = qkvz[:, :qkv_dim]
            return mixed.contiguous() if contiguous else mixed, z, ba[:, : self.num_v_heads], ba[:, self.num_v_heads :]
        r = self.num_v_heads // hk
        q, k, v, z = qkvz.view(t, hk, -1).split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = ba.view(t, hk, 2 * r).split([r, r], dim=-1)
        mixed_qkv = torch.cat([q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        return mixed_qkv, z.reshape(t, self.num_v_heads, dv), b.reshape(t, -1), a.reshape(t, -1)

    def forward(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        # (a decode step's conv reads the mixed q|k|v columns where they lie: no copy at batches over one)
        decode = fb.forward_mode.is_decode()
        mixed_qkv, z, b, a = self._split_projections(*self._projections(hidden), contiguous=not decode)
        core = fb.attn_backend.forward_linear(self, fb, mixed_qkv, a, b)  # the gates are the backend's
        out = self.norm(core.to(hidden.dtype), z)
        return self.out_proj(out.reshape(hidden.shape[0], -1))


class Qwen3NextAttention(nn.Module):
    """Tensor parallel: query heads split (q_proj column-parallel, o_proj row-parallel); key/value heads
    split, or replicated where --tp-size exceeds their count. Head counts below are this rank's."""

    def __init__(self, config: Any, layer_id: int):
        super().__init__()
        hidden, bias = config.hidden_size, config.attention_bias
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads = parallel_attention_heads(heads, kv_heads)
        self.head_dim = getattr(config, "head_dim", None) or hidden // heads
        d = self.head_dim
        kv_parts = min(kv_heads, get_tensor_model_parallel_world_size())
        self.q_proj = ColumnParallelLinear(hidden, heads * d * 2, bias=bias)
        self.k_proj = ColumnParallelLinear(hidden, kv_heads * d, bias=bias, parts=kv_parts)
        self.v_proj = ColumnParallelLinear(hidden, kv_heads * d, bias=bias, parts=kv_parts)
        self.o_proj = RowParallelLinear(heads * d, hidden, bias=bias)
        self.q_norm = RMSNorm(d, eps=config.rms_norm_eps, offset_one=True)
        self.k_norm = RMSNorm(d, eps=config.rms_norm_eps, offset_one=True)
        self.rotary_emb = get_rope(d, _rope_parameters(config))
        self.attn = RadixAttention(self.num_heads, d, d**-0.5, self.num_kv_heads, layer_id)
        # Set at load: q/k/v as one GEMM (`stacked_linears.py`), the output gate's Triton launch (its
        # function, or None: torch's ops).
        self.qkv_stack: torch.Tensor | None = None
        self.gate_mul = None

    def process_weights_after_loading(self) -> None:
        if self.qkv_stack is None:
            self.qkv_stack = stack_linear_weights([self.q_proj, self.k_proj, self.v_proj])
        self.gate_mul = None
        if triton_chosen(
            envs.SGLANG_GPU_ELEMENTWISE_BACKEND, self.o_proj.weight.device,
            "sglang.srt.layers.attention.triton_ops.output_gate",
        ):  # fmt: skip
            from sglang.srt.layers.attention.triton_ops.output_gate import sigmoid_gate_mul

            self.gate_mul = sigmoid_gate_mul

    def _projections(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_proj, k_proj, v_proj)(hidden): one GEMM on the stack where it serves (column slices of its
        product, whose rows the norms, the rotary kernel and the KV write read in place)."""
        return stacked_outputs(hidden, (self.q_proj, self.k_proj, self.v_proj), self.qkv_stack)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t, d = hidden.shape[0], self.head_dim
        qg, k, v = self._projections(hidden)
        # Each head's projection is [query | output gate].
        q, gate = qg.view(t, self.num_heads, 2 * d).split(d, dim=-1)
        k = k.view(t, self.num_kv_heads, d)
        q, k = self.rotary_emb.forward_with_norms(positions, q, k, self.q_norm, self.k_norm, fb.rope_cache)
        out = self.attn(q.reshape(t, -1), k.reshape(t, -1), v, fb)
        if self.gate_mul is not None:
            return self.o_proj(self.gate_mul(out, gate))
        return self.o_proj(out * torch.sigmoid(gate.reshape(t, -1)))


class Qwen3NextSparseMoeBlock(nn.Module):
    def __init__(self, config: Any):
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        # Qwen3.5-MoE's config has no such field: its router always renormalises the top k.
        self.norm_topk_prob = getattr(config, "norm_topk_prob", True)
        self.gate = ReplicatedLinear(hidden, config.num_experts, bias=False)
        self.experts = RoutedExperts(
            config.num_experts, hidden, config.moe_intermediate_size, config.hidden_act, True
        )
        # Its part is summed with the experts' by the block's one all-reduce (tensor parallel).
        self.shared_expert = GatedMLP(
            hidden, config.shared_expert_intermediate_size, config.hidden_act, reduce_results=False
        )
        self.shared_expert_gate = ReplicatedLinear(hidden, 1, bias=False)
        self.routing_ops = None  # the C++ top-k where the C++ op serves the experts (set at load)
        # The router and the shared gate as one GEMM and one routing launch (set at load where the fused
        # GEMMs run the shared expert: `shared_routing.py`).
        self.shared_routing: SharedRouting | None = None

    def process_weights_after_loading(self) -> None:
        self.experts.process_weights_after_loading()
        self.routing_ops = self.experts.cpu_ops
        self.experts.fuse_shared_expert(self.shared_expert, self.shared_expert_gate)
        if self.shared_routing is None:
            self.shared_routing = SharedRouting.build(
                self.gate, self.shared_expert_gate, self.experts, self.shared_expert
            )

    def fused_block(self, norm: RMSNorm) -> MoEBlock | None:
        """`hidden + self(norm(hidden))` as one C++ call, where that applies (`decode_blocks.py`)."""
        routing = (None, self.top_k, self.norm_topk_prob, 1, 1, 1.0)
        shared = (self.shared_expert, self.shared_expert_gate)
        return MoEBlock.build(norm, self.experts, self.gate.weight, self.routing_ops, shared, routing)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.shared_routing is not None and self.shared_routing.serves(x):
            out = self.shared_routing.forward(x, self.top_k, self.norm_topk_prob)
            return tensor_model_parallel_all_reduce(out)
        # The Triton top-k where the experts run their Triton bookkeeping (SGLANG_GPU_MOE_BACKEND).
        weights, ids = softmax_topk(
            self.gate(x), self.top_k, self.norm_topk_prob, self.routing_ops, self.experts.triton
        )
        return tensor_model_parallel_all_reduce(
            self.experts(x, weights, ids, self.shared_expert, self.shared_expert_gate)
        )


def is_sparse_layer(config: Any, layer_id: int) -> bool:
    """Whether the layer's MLP is the MoE. Qwen3.5's configs have none of these fields (no experts:
    dense everywhere) or only `num_experts` (Qwen3.5-MoE: a MoE in every layer)."""
    return (
        layer_id not in (getattr(config, "mlp_only_layers", None) or [])
        and getattr(config, "num_experts", 0) > 0
        and (layer_id + 1) % getattr(config, "decoder_sparse_step", 1) == 0
    )


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, config: Any, layer_id: int, gdn_cls: type[Qwen3NextGatedDeltaNet]):
        super().__init__()
        self.is_linear = config.layer_types[layer_id] == "linear_attention"
        if self.is_linear:
            self.linear_attn = gdn_cls(config, layer_id)
        else:
            self.self_attn = Qwen3NextAttention(config, layer_id)
        if is_sparse_layer(config, layer_id):
            self.mlp = Qwen3NextSparseMoeBlock(config)
        elif getattr(config, "intermediate_size", None):
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)
        else:
            raise ValueError(f"Layer {layer_id} has neither experts nor an intermediate_size in the config.")
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset_one=True)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset_one=True)
        # Each half of the layer as one C++ call where its parts all run C++ ops (CPU; set at load).
        self.mixer_block: GdnBlock | AttentionBlock | None = None
        self.mlp_block: MoEBlock | MLPBlock | None = None

    def process_weights_after_loading(self) -> None:
        """After the children's (`load_model` runs them first): the fused CPU blocks where they apply."""
        norm = self.input_layernorm
        if self.is_linear:
            self.mixer_block = GdnBlock.build(norm, self.linear_attn)
        else:
            attn = self.self_attn
            qk_norms = (attn.q_norm, attn.k_norm)
            self.mixer_block = AttentionBlock.build(norm, attn, qk_norms, attn.rotary_emb, output_gate=True)
        if isinstance(self.mlp, Qwen3NextSparseMoeBlock):
            self.mlp_block = self.mlp.fused_block(self.post_attention_layernorm)
        else:
            self.mlp_block = MLPBlock.build(self.post_attention_layernorm, self.mlp)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The layer on `hidden + residual` (residual None: `hidden` alone); returns (out, residual), whose
        sum is the layer's output. Without the CPU decode blocks the residual adds are deferred into the
        norm after them (`RMSNorm.add_and_norm`: one kernel each on CUDA, upstream's fused add-RMSNorm);
        the blocks take and give whole hidden states (residual None)."""
        if self.mixer_block is not None or self.mlp_block is not None:
            return self._whole(positions, hidden if residual is None else hidden + residual, fb), None
        x, residual = self.input_layernorm.add_and_norm(hidden, residual)
        x = self.linear_attn(x, fb) if self.is_linear else self.self_attn(positions, x, fb)
        x, residual = self.post_attention_layernorm.add_and_norm(x, residual)
        return self.mlp(x), residual

    def _whole(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The layer where the CPU decode blocks are built (each steps aside where its batch does not fit
        its op: the parts then run one by one)."""
        fused = self.mixer_block(hidden, fb) if self.mixer_block is not None else None
        if fused is not None:
            hidden = fused
        else:
            x = self.input_layernorm(hidden)
            x = self.linear_attn(x, fb) if self.is_linear else self.self_attn(positions, x, fb)
            hidden = hidden + x
        fused = self.mlp_block(hidden) if self.mlp_block is not None else None
        return fused if fused is not None else hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3NextModel(nn.Module):
    def __init__(self, config: Any, gdn_cls: type[Qwen3NextGatedDeltaNet]):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Qwen3NextDecoderLayer(config, i, gdn_cls) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps, offset_one=True)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, fb, residual)
        return self.norm.add_and_norm(hidden, residual)[0]


class Qwen3NextForCausalLM(HybridCausalLM):
    backbone_attr = "model"
    fp32_param_suffixes = ("A_log", "dt_bias")
    gdn_cls = Qwen3NextGatedDeltaNet  # the linear layers' class (Qwen3.5's loads other projections)
    checkpoint_renames = ((".experts.gate_up_proj", ".experts.w13"), (".experts.down_proj", ".experts.w2"))
    fp8_dense_modules = ("linear_attn.in_proj_qkvz", "linear_attn.in_proj_ba")

    def __init__(self, config: Any):
        model = Qwen3NextModel(config, self.gdn_cls)
        super().__init__(config, model, model.embed_tokens)

    def served_form(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        module, _, attr = name.rpartition(".")  # `attr` is "weight"; `module` a projection or not
        layer, _, proj = module.rpartition(".")
        if proj in ("in_proj_qkvz", "in_proj_ba") and layer.endswith(".linear_attn"):
            try:
                mixer = self.get_submodule(layer)
            except AttributeError:  # no such layer: the loader names the tensor as unused
                return tensor
            return mixer.served_projection(getattr(mixer, proj), tensor)
        return tensor


def _rope_parameters(config: Any) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters`; older checkpoints state rope_theta and
    partial_rotary_factor at the top level."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    scaling = getattr(config, "rope_scaling", None) or {}
    return {
        "rope_type": scaling.get("rope_type", scaling.get("type", "default")),
        "rope_theta": getattr(config, "rope_theta", 10000.0),
        "partial_rotary_factor": getattr(config, "partial_rotary_factor", 1.0),
    }
