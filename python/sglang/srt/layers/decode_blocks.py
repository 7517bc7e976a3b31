"""Whole decoder blocks in one sgl-kernel call on CPU (`sgl-kernel/csrc/decode_blocks_cpu.cpp`).

A block is `hidden + f(norm(hidden))`: each half of a Qwen3-Next layer (`GdnBlock` or `AttentionBlock`,
then `MoEBlock` or `MLPBlock`), each Nemotron-H block (`Mamba2Block`, `AttentionBlock`, `MoEBlock`,
`MLPBlock`). Called one by one from Python, a block's parts are ~15-25 torch and sgl-kernel calls; at the
tiny presets' decode sizes each call's overhead is several times its own work. The C++ op makes
the same calls on the same tensors (so the result is the one-by-one path's bit for bit) without the
Python between them.

Each block is built after the weights are loaded, only where every part of it runs its own C++ op
(float32 weights, each part's SGLANG_CPU_*_BACKEND choice and size limits, no part on its Triton
kernel, the layer's shared expert fused into the experts' op); per batch it returns None where a part
would not (an extend for the mixers and attention, more tokens than the MoE op's limits, a float8 KV
pool, another attention backend), and the model then calls its modules as before.
`SGLANG_CPU_DECODE_BLOCKS=0` turns the blocks off; under tensor parallelism they are off (a block's
output needs the TP all-reduce before its residual add).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from sglang.srt.distributed import get_tensor_model_parallel_world_size
from sglang.srt.environ import envs
from sglang.srt.layers.activation import get_act_fn
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.moe.experts import CPU_OP_ACTIVATIONS, RoutedExperts
from sglang.srt.layers.moe.router import cpp_routes

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


def _all_float32(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or t.dtype == torch.float32 for t in tensors)


# Where the models keep their blocks: a Qwen3-Next layer's two halves, a Nemotron-H block.
BLOCK_ATTRS = ("mixer_block", "mlp_block", "fused")


def built_blocks(model: nn.Module) -> list[tuple[nn.Module, str, Any]]:
    """(module, attribute, block) for every block the model built, in module order."""
    found = ((m, a, getattr(m, a, None)) for m in model.modules() for a in BLOCK_ATTRS)
    return [(m, a, b) for m, a, b in found if b is not None]


def _blocks_on(*parts: nn.Module | None) -> bool:
    """The switch is on and every part runs its C++ op (so the extension, which holds the blocks, is
    loaded): its `cpu_ops` is set and it does not run its Triton kernel instead (a
    SGLANG_GPU_*_BACKEND=triton choice, which the modules check first, also on CPU under the interpreter).
    None parts are absent ones."""
    present = [p for p in parts if p is not None]
    if any(p.cpu_ops is None or getattr(p, "triton", False) for p in present):
        return False
    if get_tensor_model_parallel_world_size() > 1:
        return False  # a block adds its residual in C++, where a rank's partial sum is not yet reduced
    return envs.SGLANG_CPU_DECODE_BLOCKS.get()


def _norm_args(norm: nn.Module) -> tuple[torch.Tensor, float, float]:
    return norm.weight, norm.eps, 1.0 if getattr(norm, "offset_one", False) else 0.0


def _linear_backend(fb: ForwardBatch) -> Any:
    """The batch's linear-attention backend where it runs the C++ decode step, else None."""
    if not fb.forward_mode.is_decode():
        return None
    backend = fb.attn_backend.linear_attn_backend
    return backend if backend.decode_cpp else None


class GdnBlock:
    """Qwen3-Next's `hidden + GatedDeltaNet(input_layernorm(hidden))` for a decode batch."""

    @classmethod
    def build(cls, norm: nn.Module, mixer: nn.Module) -> GdnBlock | None:
        weights = (norm.weight, mixer.in_proj_qkvz.weight, mixer.in_proj_ba.weight, mixer.conv1d.weight)
        weights += (mixer.A_log, mixer.dt_bias, mixer.norm.weight, mixer.out_proj.weight)
        biases = (mixer.in_proj_qkvz.bias, mixer.in_proj_ba.bias, mixer.conv1d.bias, mixer.out_proj.bias)
        if not (_blocks_on(norm, mixer, mixer.norm) and mixer.projections_grouped and _all_float32(*weights)):
            return None
        if any(b is not None for b in biases):
            return None
        return cls(norm, mixer)

    def __init__(self, norm: nn.Module, mixer: nn.Module):
        self.op = torch.ops.sgl_kernel.gdn_block_decode.default
        self.layer_id = mixer.layer_id
        self.head = (*_norm_args(norm), mixer.in_proj_qkvz.weight, mixer.in_proj_ba.weight)
        self.conv_weight = mixer.conv1d.weight.view(mixer.conv1d.weight.shape[0], -1)
        self.tail = (mixer.A_log, mixer.dt_bias, mixer.norm.weight, mixer.norm.eps, mixer.out_proj.weight)
        self.tail += (mixer.num_k_heads, mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim)

    def __call__(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor | None:
        backend = _linear_backend(fb)
        if backend is None:
            return None
        conv, ssm = backend.mamba_pool.layer_cache(self.layer_id)
        return self.op(hidden, *self.head, conv, self.conv_weight, ssm, backend.meta.slots, *self.tail)


class Mamba2Block:
    """Nemotron-H's `hidden + Mamba2Mixer(norm(hidden))` for a decode batch."""

    @classmethod
    def build(cls, norm: nn.Module, mixer: nn.Module) -> Mamba2Block | None:
        weights = (norm.weight, mixer.in_proj.weight, mixer.in_proj.bias, mixer.conv1d.weight, mixer.conv1d.bias)
        weights += (mixer.dt_bias, mixer.A_log, mixer.D, mixer.norm.weight, mixer.out_proj.weight, mixer.out_proj.bias)
        if not (_blocks_on(norm, mixer.norm) and _all_float32(*weights)):
            return None
        if getattr(norm, "offset_one", False):
            return None  # Nemotron-H's norms are `weight * norm(x)`; the op passes no offset
        if not getattr(mixer.norm, "gate_first", False):
            return None  # the op's output norm gates first (Falcon-H1's may gate after, or not norm)
        return cls(norm, mixer)

    def __init__(self, norm: nn.Module, mixer: nn.Module):
        self.op = torch.ops.sgl_kernel.mamba2_block_decode.default
        self.layer_id = mixer.layer_id
        self.head = (norm.weight, norm.eps, mixer.in_proj.weight, mixer.in_proj.bias)
        self.conv = (mixer.conv1d.weight.view(mixer.conv1d.weight.shape[0], -1), mixer.conv1d.bias)
        out_norm = mixer.norm
        self.tail = (mixer.dt_bias, mixer.A_log, mixer.D, mixer.time_step_min, out_norm.weight, out_norm.eps)
        self.tail += (out_norm.group_size, mixer.out_proj.weight, mixer.out_proj.bias)
        self.tail += (mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size)

    def __call__(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor | None:
        backend = _linear_backend(fb)  # its C++ step is the mixer op this block calls
        if backend is None:
            return None
        conv, ssm = backend.mamba_pool.layer_cache(self.layer_id)
        return self.op(hidden, *self.head, conv, *self.conv, ssm, backend.meta.slots, *self.tail)


class MoEBlock:
    """`hidden + MoE(norm(hidden))` (routed experts with the shared expert inside the experts' C++ op) for
    a batch of few tokens, any forward mode."""

    @classmethod
    def build(
        cls,
        norm: nn.Module,
        experts: RoutedExperts,
        router_weight: torch.Tensor,
        routing_ops: Any,
        shared: tuple[nn.Module, nn.Linear | None],
        routing: tuple,
    ) -> MoEBlock | None:
        """`routing`: (correction_bias or None, top_k, renormalize, num_groups, topk_groups, scaling), the
        router's arguments (softmax top-k without a correction bias, grouped sigmoid top-k with one)."""
        ok = _blocks_on(norm, experts) and routing_ops is not None
        ok = ok and experts.fused_shared == shared and _all_float32(norm.weight, router_weight, routing[0])
        return cls(norm, experts, router_weight, routing_ops, shared, routing) if ok else None

    def __init__(self, norm, experts, router_weight, routing_ops, shared, routing):
        self.op = torch.ops.sgl_kernel.moe_block_decode.default
        self.experts, self.routing_ops, self.shared = experts, routing_ops, shared
        self.num_experts, self.top_k = router_weight.shape[0], routing[1]
        self.head = (*_norm_args(norm), router_weight, *routing)
        self.tail = experts.cpu_op_args(fused=True)

    def __call__(self, hidden: torch.Tensor, fb: ForwardBatch | None = None) -> torch.Tensor | None:
        tokens = hidden.shape[0]
        if not (
            cpp_routes(self.routing_ops, tokens, self.num_experts)
            and self.experts.cpu_op_serves(tokens * self.top_k)
            and self.experts.cpu_op_fuses_shared(tokens, *self.shared)
        ):
            return None
        return self.op(hidden, *self.head, *self.tail)


class AttentionBlock:
    """`hidden + Attention(norm(hidden))` for a decode batch: Nemotron-H's plain attention, or Qwen3-Next's
    with q/k norms, rotary embedding and a per-head output gate."""

    @classmethod
    def build(
        cls,
        norm: nn.Module,
        attn: nn.Module,
        qk_norms: tuple[nn.Module, nn.Module] | None = None,
        rope: nn.Module | None = None,
        output_gate: bool = False,
    ) -> AttentionBlock | None:
        projections = (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)
        norms = (norm, *(qk_norms or ()))
        weights = [n.weight for n in norms] + [t for p in projections for t in (p.weight, p.bias)]
        if not (_blocks_on(*norms, rope) and _all_float32(*weights)):
            return None
        if qk_norms and (qk_norms[0].eps, qk_norms[0].offset_one) != (qk_norms[1].eps, qk_norms[1].offset_one):
            return None  # the op takes one eps and offset for both
        return cls(norm, attn, qk_norms, rope, output_gate)

    def __init__(self, norm, attn, qk_norms, rope, output_gate):
        self.op = torch.ops.sgl_kernel.attention_block_decode.default
        radix = attn.attn
        self.layer_id = radix.layer_id
        self.head = (*_norm_args(norm),)
        for p in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj):
            self.head += (p.weight, p.bias)
        self.head += (qk_norms[0].weight, qk_norms[1].weight, *_norm_args(qk_norms[0])[1:]) if qk_norms else (
            None, None, 0.0, 0.0,
        )  # fmt: skip
        self.rope = (rope.inv_freq, rope.rotary_dim) if rope is not None else (None, 0)
        self.tail = (radix.scaling, radix.tp_q_head_num, radix.tp_k_head_num, radix.head_dim, output_gate)

    def __call__(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor | None:
        if not fb.forward_mode.is_decode():
            return None
        backend = fb.attn_backend.full_attn_backend
        # What the block does is the torch-native backend's C++ decode (`--attention-backend triton` is not).
        if not isinstance(backend, TorchNativeAttnBackend) or backend.cpu_ops is None:
            return None
        k_buf, v_buf = backend.kv_pool.get_kv_buffer(self.layer_id)
        if k_buf.element_size() == 1:
            return None  # float8 pools are written through a byte view (`set_kv_buffer`)
        return self.op(
            hidden, *self.head, fb.positions, *self.rope, k_buf, v_buf, fb.out_cache_loc, backend.req_to_token,
            fb.req_pool_indices, fb.seq_lens, *self.tail,
        )  # fmt: skip


class MLPBlock:
    """`hidden + MLP(norm(hidden))` for a dense MLP (gated or plain), any batch."""

    @classmethod
    def build(cls, norm: nn.Module, mlp: nn.Module) -> MLPBlock | None:
        linears = [getattr(mlp, "gate_proj", None), mlp.up_proj, mlp.down_proj]
        weights = [norm.weight] + [t for lin in linears if lin is not None for t in (lin.weight, lin.bias)]
        code = next((c for name, c in CPU_OP_ACTIVATIONS.items() if get_act_fn(name) is mlp.act), None)
        ok = _blocks_on(norm) and code is not None and _all_float32(*weights)
        return cls(norm, linears, code) if ok else None

    def __init__(self, norm, linears, activation: int):
        self.op = torch.ops.sgl_kernel.mlp_block_decode.default
        gate, up, down = linears
        self.args = (*_norm_args(norm), *((gate.weight, gate.bias) if gate is not None else (None, None)))
        self.args += (up.weight, up.bias, down.weight, down.bias, activation)

    def __call__(self, hidden: torch.Tensor, fb: ForwardBatch | None = None) -> torch.Tensor:
        return self.op(hidden, *self.args)
