"""Routed experts stored stacked: `w13` [E, 2I, H] (gate rows then up rows) for gated experts or
[E, I, H] (up) for plain ones, and `w2` [E, H, I] (down). Tokens are grouped by expert (sorted once per
layer). Small batches (decode) run every expert at once as two batched matmuls over a zero-padded
[E, max tokens per expert, H] block; large ones (prefill) run each expert once on its tokens, where the
padding would cost more than the per-expert calls. Both accumulate each token's experts in the same
order (they agreed bit for bit where measured; matmul kernels may round differently in general).

On an accelerator the host never reads the per-expert counts (that would be a device sync per layer):
`forward_device` groups the sorted tokens with `torch._grouped_mm` over device offsets (bfloat16, the
serving dtype on GPUs), or, where grouped GEMMs do not apply (float32, unaligned dims), runs the
padded batched form with room for every token in every expert, up to BATCHED_MAX_ASSIGNMENTS (decode
sizes; larger batches take the per-expert path, one sync per layer). A fixed number of launches per
layer either way, so it is also what a CUDA graph can capture; on CUDA the bookkeeping around the
grouped GEMMs is three Triton launches (`dispatch_triton.py`, `SGLANG_GPU_MOE_BACKEND`, which also puts
Qwen3-Next's routing on its Triton kernel). 16-bit decode batches (up to FUSED_AUTO_MAX_TOKENS tokens)
run as fused Triton grouped GEMMs instead (`fused_moe_triton.py`; `triton_fused`: every batch;
`triton_grouped`: none). On CPU, decode-size batches take the grouped GEMMs too
(any float dtype there), faster than the padded block; for small experts, sgl-kernel's C++ op instead
(`sgl-kernel/csrc/moe_cpu.cpp`, `SGLANG_CPU_MOE_BACKEND`), whose weights are the same
parameters stored transposed (`process_weights_after_loading`). The layer's shared expert (and its sigmoid
gate, Qwen3-Next) is added here too: where the C++ op serves the layer, it runs inside the same call
(`fuse_shared_expert`). Experts whose weights are float8_e4m3fn (block FP8, with `w13_weight_scale_inv` /
`w2_weight_scale_inv`) take `fused_moe_fp8_triton.py` instead: its Triton kernels where the Triton path
serves (CUDA), its torch twin elsewhere; the weights' dtype alone decides. Their FP8 shared expert runs
as one more expert of theirs where it fits (`fp8_fused_experts.py`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import (
    get_moe_expert_parallel_rank,
    get_moe_expert_parallel_world_size,
    get_tensor_model_parallel_world_size,
)
from sglang.srt.environ import envs
from sglang.srt.layers.activation import get_act_fn
from sglang.srt.layers.cpu_ops import cpu_moe_ops
from sglang.srt.layers.gpu_ops import triton_chosen
from sglang.srt.layers.linear import DimShard, set_weight_shards, shard_tensor
from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.moe.sort_combine import combine, sort_by_expert

EXPERT_SHARDS = ("gate", "up", "down")
# Batched path up to this many (token, expert) assignments, and while the padded block holds at most
# PADDING_LIMIT times the assignments. Measured on CPU (tiny preset shapes, one thread): 3x faster at 64
# tokens x top-2, 1.2x at 512 tokens, slower from ~1,024 tokens.
BATCHED_MAX_ASSIGNMENTS = 1024
PADDING_LIMIT = 4
# The C++ op's activations, by the codes it takes.
CPU_OP_ACTIVATIONS = {"silu": 0, "swish": 0, "relu2": 1, "relu": 2, "gelu": 3}
# The C++ op serves experts of at most this many weights (w13 + w2) and batches of at most
# BATCHED_MAX_ASSIGNMENTS. Against the grouped GEMMs (`benchmark/bench_moe_cpu.py`, one thread): 4-6k
# weights per expert (the tiny presets) 1.2-13x faster from 1 to 512 tokens; 98k (hidden 256) 1.1-1.7x;
# 393k (hidden 512) 0.75-0.82x, where the weights stream from memory and torch's GEMMs read them better.
CPU_OP_MAX_EXPERT_WEIGHTS = 128 * 1024
# The shared expert runs inside the op up to this many tokens; above, as torch GEMMs beside it. The tiny
# Qwen3-Next's MoE block (one thread): fused / unfused 24 / 47 us at 1 token, 82 / 94 us at 64, 252 / 241
# at 256, 489 / 426 at 500.
CPU_OP_MAX_SHARED_TOKENS = 128
# SGLANG_GPU_MOE_BACKEND=auto on CUDA: 16-bit batches of at most this many tokens (decode) run the fused
# Triton GEMMs (`fused_moe_triton.py`), larger ones (prefill chunks) the grouped_mm path. Measured on an
# H200 (2026-11-30, `benchmark/gpu/README.md`), the 80B's MoE layer with its shared expert stacked and the
# committed tiles: fused 1.56 / 1.57 / 1.49 / 1.36x the grouped_mm path at 1 / 8 / 64 / 256 tokens (23 / 64
# / 84 / 78 % of the weight floor against 15 / 41 / 56 / 57 %), and the 80B slice's decode step
# 1.09-1.29x; its prefill of 8,192-token chunks 0.81x. Between 256 and 8,192 tokens nothing is measured:
# the grouped path, as before. SGLANG_GPU_MOE_BACKEND=triton_grouped keeps the grouped path at every size
# (the default before; a benchmark's baseline).
FUSED_AUTO_MAX_TOKENS = 256


class RoutedExperts(nn.Module):
    """Tensor and expert parallelism: the layer's `num_experts` experts are spread over the EP group's
    ranks (`--ep-size`: each holds num_experts / ep whole experts, `num_experts` here is that count), and
    each expert's intermediate dimension over the tp / ep ranks that hold the same experts. A rank's
    output is its part of the sum, which the MoE block all-reduces over the TP group once, with the shared
    expert's part (also split by its intermediate dimension). Every rank already holds every token (the
    attention before it is tensor-parallel, not data-parallel), so dispatch is local: assignments to
    other ranks' experts get the id `num_experts`, one past the local experts, and weight 0
    (`_local_assignments`); every path sorts them last and computes no GEMM row for them, and the block's
    one all-reduce is the combine; no all-to-all or all-gather runs."""

    # --enable-return-routed-experts: the capture this layer's routing goes to, and its decoder layer
    # (`model_executor/routed_experts.py`); None: not recorded.
    routing_capture: Any = None
    routing_layer: int = 0

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, act: str, gated: bool):
        super().__init__()
        tp, ep = get_tensor_model_parallel_world_size(), get_moe_expert_parallel_world_size()
        if num_experts % ep:
            raise ValueError(f"--ep-size {ep} does not divide the model's {num_experts} experts.")
        self.global_num_experts = num_experts
        self.num_experts = num_experts // ep
        self.expert_offset = get_moe_expert_parallel_rank() * self.num_experts
        # Experts over the EP group (rank r of the TP group is rank r % ep of its EP group), the
        # intermediate dimension over the tp / ep ranks holding the same experts.
        experts = DimShard(0, (num_experts,), ep, tuple(r % ep for r in range(tp)))
        inter = [intermediate_size] * (2 if gated else 1)
        moe_tp = tp // ep
        if intermediate_size % moe_tp:
            raise ValueError(
                f"The experts' intermediate size {intermediate_size} does not split over --tp-size {tp} / "
                f"--ep-size {ep} ranks."
            )
        rows, cols = (DimShard(d, tuple(p), moe_tp, tuple(r // ep for r in range(tp))) for d, p in
                      ((1, inter), (2, inter[:1])))  # fmt: skip
        self.inter_shard = rows
        self.intermediate_size = intermediate_size // moe_tp
        self.gated = gated
        rows_local = 2 * self.intermediate_size if gated else self.intermediate_size
        self.w13 = nn.Parameter(torch.empty(self.num_experts, rows_local, hidden_size))
        self.w2 = nn.Parameter(torch.empty(self.num_experts, hidden_size, self.intermediate_size))
        set_weight_shards(self.w13, experts, rows)
        set_weight_shards(self.w2, experts, cols)
        self.act = get_act_fn(act)
        self.act_code = CPU_OP_ACTIVATIONS.get(act)
        self.cpu_ops = None  # set by process_weights_after_loading where the C++ op serves this layer
        self.triton = False  # the Triton bookkeeping around the grouped GEMMs (CUDA; set at load)
        # The fused Triton GEMMs for 16-bit batches (CUDA's default up to FUSED_AUTO_MAX_TOKENS; set at load).
        self.fused_gemms = None
        # Set by fuse_shared_expert: (the shared expert, its gate) and the op's arguments for them.
        self.fused_shared: tuple[nn.Module, nn.Linear | None] | None = None
        self.fused_shared_args: tuple[torch.Tensor, torch.Tensor] | None = None  # (w13t, w2t)

    def process_weights_after_loading(self) -> None:
        """On CPU, where the C++ op serves this layer, store w13 / w2 transposed (contiguous [E, H, R] and
        [E, I, H]; the parameters become views of them with their usual shapes, so every torch path
        reads them as before). On CUDA (SGLANG_GPU_MOE_BACKEND auto, or triton on any device: up to
        FUSED_AUTO_MAX_TOKENS tokens; triton_fused: any batch; triton_grouped: none), the fused GEMMs for
        16-bit experts. Runs once however often it is called."""
        self.triton = triton_chosen(
            envs.SGLANG_GPU_MOE_BACKEND, self.w13.device,
            "sglang.srt.layers.moe.dispatch_triton", "sglang.srt.layers.moe.routing_triton",
            "sglang.srt.layers.moe.elementwise_triton", also_triton=("triton_fused", "triton_grouped"),
        )  # fmt: skip
        if not self.fp8:  # the C++ op takes float weights
            self._use_cpu_op()
        backend = envs.SGLANG_GPU_MOE_BACKEND.get()
        fused = self.triton and backend in ("auto", "triton", "triton_fused")
        if self.fused_gemms is None and fused and not self.fp8 and self.cpu_ops is None:
            # (imported here: a CPU install may lack triton)
            from sglang.srt.layers.moe.fused_moe_triton import FusedExperts

            # Only for the dtypes it serves: for others (float32) it would run nothing, yet stack the
            # shared expert (a copy of the weights); and the C++ op reads its own transposed storage.
            if self.w13.dtype in FusedExperts.DTYPES:
                bound = None if backend == "triton_fused" else FUSED_AUTO_MAX_TOKENS
                self.fused_gemms = FusedExperts(self, max_tokens=bound)
        if self.fused_gemms is None and self.fp8:  # (the shared expert as one more FP8 expert)
            from sglang.srt.layers.moe.fp8_fused_experts import Fp8FusedExperts

            self.fused_gemms = Fp8FusedExperts(self)

    def _use_cpu_op(self) -> None:
        """Where sgl-kernel's C++ op serves this layer (CPU, its activations, small experts), sets
        `cpu_ops` and stores w13 / w2 transposed (once)."""
        ops = cpu_moe_ops(self.w13.device)
        weights_per_expert = self.w13.shape[1] * self.w13.shape[2] + self.w2.shape[1] * self.w2.shape[2]
        if ops is None or self.act_code is None or weights_per_expert > CPU_OP_MAX_EXPERT_WEIGHTS:
            return
        if self.cpu_ops is None:
            for param in (self.w13, self.w2):
                param.data = param.data.transpose(1, 2).contiguous().transpose(1, 2)
        self.cpu_ops = ops

    def fuse_shared_expert(self, mlp: nn.Module, gate: nn.Linear | None = None) -> None:
        """After loading: where the C++ op serves this layer, give it the layer's shared expert `mlp` (a
        GatedMLP for gated experts, a PlainMLP for plain ones, of the same activation, without biases) and
        its sigmoid `gate` ([1, H], or None), so decode batches run both in one call. The MLP's weights are
        stored transposed, [H, R] and [I, H], and its Linear weights become views of them (same values and
        shapes for its torch forward). Where anything differs, the shared expert stays a torch MLP."""
        self.process_weights_after_loading()
        if self.fused_gemms is not None:
            self.fused_gemms.fuse_shared(self, mlp, gate)  # the fused GEMMs run it as one more expert
        gated_mlp = hasattr(mlp, "gate_proj")
        linears = [mlp.gate_proj, mlp.up_proj] if gated_mlp else [mlp.up_proj]
        linears.append(mlp.down_proj)
        plain = all(lin.bias is None for lin in linears) and (gate is None or gate.bias is None)
        size = sum(lin.weight.numel() for lin in linears)
        dtypes_ok = all(lin.weight.dtype == self.w13.dtype for lin in linears)
        same = gated_mlp == self.gated and mlp.act is self.act and dtypes_ok
        if self.cpu_ops is None or not plain or not same or size > CPU_OP_MAX_EXPERT_WEIGHTS:
            return
        if self.fused_shared is not None and self.fused_shared[0] is not mlp:
            raise ValueError("This layer's experts already run another shared expert inside the C++ op.")
        if self.fused_shared is None:
            up = torch.cat([lin.weight.data for lin in linears[:-1]]) if gated_mlp else linears[0].weight.data
            w13t, w2t = up.t().contiguous(), mlp.down_proj.weight.data.t().contiguous()
            start = 0
            for lin in linears[:-1]:
                rows = lin.weight.shape[0]
                lin.weight.data = w13t[:, start : start + rows].t()
                start += rows
            mlp.down_proj.weight.data = w2t.t()
        else:
            w13t, w2t = self.fused_shared_args[:2]
        self.fused_shared = (mlp, gate)
        self.fused_shared_args = (w13t, w2t)

    def load_expert_weight(self, expert: int, shard: str, weight: torch.Tensor) -> None:
        """One expert's `gate_proj` / `up_proj` / `down_proj` weight as HF checkpoints store it."""
        self.expert_weight_rows(expert, shard, weight).copy_(weight)

    def local_expert_weight(
        self, expert: int, shard: str, weight: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(the view of w13 / w2 it loads into, this rank's part of it) for the checkpoint's `weight` of
        global expert `expert`'s `shard`; (None, weight) for an expert another EP rank holds."""
        if not 0 <= expert < self.global_num_experts:
            raise ValueError(f"Expert {expert} does not exist: the layer has {self.global_num_experts}.")
        local = expert - self.expert_offset
        if not 0 <= local < self.num_experts:
            return None, weight
        if self.inter_shard.parts > 1:
            dim = 1 if shard == "down" else 0
            full = self.inter_shard.pieces[0]
            if weight.dim() != 2 or weight.shape[dim] != full:
                raise ValueError(
                    f"Expert {expert} {shard}_proj has shape {tuple(weight.shape)}; its intermediate "
                    f"dimension should be {full}."
                )
            single = DimShard(dim, (full,), self.inter_shard.parts, self.inter_shard.part_of_rank)
            weight = shard_tensor(weight, (single,))
        return self.expert_weight_rows(local, shard, weight), weight

    def expert_weight_rows(self, expert: int, shard: str, weight: torch.Tensor) -> torch.Tensor:
        """The view of w13 / w2 that one expert's checkpoint `weight` of `shard` loads into; ValueError
        where `weight` does not fit it."""
        inter = self.intermediate_size
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"Expert {expert} does not exist: the layer has {self.num_experts}.")
        if shard == "down":
            target = self.w2.data[expert]
        elif shard == "gate":
            if not self.gated:
                raise ValueError("Plain experts have no gate_proj.")
            target = self.w13.data[expert, :inter]
        elif shard == "up":
            target = self.w13.data[expert, inter:] if self.gated else self.w13.data[expert]
        else:
            raise ValueError(f"Unknown expert weight {shard!r}; expected one of {EXPERT_SHARDS}.")
        if weight.shape != target.shape:
            # copy_ would broadcast a wrong-shaped tensor silently.
            raise ValueError(
                f"Expert {expert} {shard}_proj has shape {tuple(weight.shape)}, expected {tuple(target.shape)}."
            )
        return target

    def forward(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        shared_expert: nn.Module | None = None,
        shared_gate: nn.Linear | None = None,
    ) -> torch.Tensor:
        """x [T, H]; weights, ids [T, k]. Returns [T, H] in x's dtype, accumulated in float32, plus the
        layer's `shared_expert(x)` where given (times sigmoid(`shared_gate`(x)) where given). `ids` are
        global expert ids; under tensor / expert parallelism the result is this rank's part of the sum."""
        if self.routing_capture is not None:
            self.routing_capture.record(self.routing_layer, ids)
        masked = self.num_experts != self.global_num_experts
        if masked:
            weights, ids = self._local_assignments(weights, ids)
        if self.fused_gemms is not None and self.fused_gemms.serves(self, x):
            return self.fused_gemms.forward(self, x, weights, ids, shared_expert, shared_gate)
        if self.fp8:  # (the routed FP8 experts alone: `fp8_fused_experts.py`)
            from sglang.srt.layers.moe.fp8_fused_experts import routed_fp8

            return self._add_shared(routed_fp8(self, x, weights, ids), x, shared_expert, shared_gate)
        if masked and self.cpu_op_serves(ids.numel()):
            return self._add_shared(self._cpu_op_local(x, weights, ids), x, shared_expert, shared_gate)
        if self.cpu_op_serves(ids.numel()):
            fused = self.cpu_op_fuses_shared(x.shape[0], shared_expert, shared_gate)
            w13t, w2t, gated, act, *shared = self.cpu_op_args(fused)
            out = self.cpu_ops.moe_experts(
                x.float().contiguous(),
                w13t,
                w2t,
                weights.float().contiguous(),
                ids.contiguous(),
                gated,
                act,
                *shared,
            )
            out = out.to(x.dtype)
            return out if fused else self._add_shared(out, x, shared_expert, shared_gate)
        return self._add_shared(self._routed(x, weights, ids), x, shared_expert, shared_gate)

    def _local_assignments(
        self, weights: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Assignments to this rank's experts as local ids; the others get id `num_experts` (one past the
        local experts) and weight 0. No shape depends on the routing (what a CUDA graph needs): the sorts
        put those assignments last, the group offsets count the local experts only, so the grouped GEMMs
        (and the per-expert loop) compute no row for them; each rank computes the rows routed to its
        experts, about T k / ep."""
        local = ids - self.expert_offset
        mine = (local >= 0) & (local < self.num_experts)
        return weights * mine, torch.where(mine, local, self.num_experts)

    def _cpu_op_local(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The C++ op (which refuses ids outside its experts) on this rank's assignments only, one per
        row (CPU: reading which they are costs no sync); their outputs summed per token in float32."""
        keep = (ids < self.num_experts).reshape(-1).nonzero().squeeze(1)
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        if keep.numel():
            tokens = keep // ids.shape[1]
            w13t, w2t, gated, act = self.cpu_op_args(False)
            rows = self.cpu_ops.moe_experts(
                x[tokens].float().contiguous(), w13t, w2t, weights.reshape(-1)[keep, None].float().contiguous(),
                ids.reshape(-1)[keep, None].contiguous(), gated, act,
            )  # fmt: skip
            out.index_add_(0, tokens, rows.float())
        return out.to(x.dtype)

    @property
    def fp8(self) -> bool:
        """Experts stored in block FP8 (float8_e4m3fn weights with `w13_weight_scale_inv` and
        `w2_weight_scale_inv`, upstream's names, set by the loader): decided by the weights' dtype alone."""
        return self.w13.dtype == torch.float8_e4m3fn

    def cpu_op_serves(self, assignments: int) -> bool:
        """Whether the C++ op runs a batch of this many (token, expert) assignments."""
        return self.cpu_ops is not None and assignments <= BATCHED_MAX_ASSIGNMENTS

    def cpu_op_fuses_shared(
        self, num_tokens: int, shared_expert: nn.Module | None, shared_gate: nn.Linear | None
    ) -> bool:
        """Whether the C++ op runs this shared expert (and gate) inside its call for `num_tokens` tokens."""
        return (
            shared_expert is not None
            and self.fused_shared == (shared_expert, shared_gate)
            and num_tokens <= CPU_OP_MAX_SHARED_TOKENS
        )

    def cpu_op_args(self, fused: bool) -> tuple:
        """The C++ op's arguments after x, weights and ids: the stored-transposed experts, their kind, and
        the shared expert's weights where `fused`."""
        head = (self.w13.transpose(1, 2), self.w2.transpose(1, 2), self.gated, self.act_code)
        if not fused:
            return head
        # The gate as the op reads it, from the parameter as it is now (an in-place weight update changes
        # it): a view of a float32 gate, a float32 copy of another.
        gate = self.fused_shared[1]
        gate_vec = None if gate is None else gate.weight.float().reshape(-1).contiguous()
        return head + (*self.fused_shared_args, gate_vec)

    def _add_shared(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        shared_expert: nn.Module | None,
        shared_gate: nn.Linear | None,
    ) -> torch.Tensor:
        if shared_expert is None:
            return out
        k = self._elementwise_kernels()
        if k is not None and isinstance(shared_expert, GatedMLP) and shared_expert.act is F.silu:
            shared = shared_expert.down_proj(k.silu_mul(shared_expert.gate_proj(x), shared_expert.up_proj(x)))
        else:
            shared = shared_expert(x)
        if shared_gate is None:
            return out + shared
        gate = shared_gate(x)
        if k is not None and gate.dtype == out.dtype == shared.dtype:
            return k.add_sigmoid_mul(out, shared, gate)
        return out + torch.sigmoid(gate) * shared

    def _elementwise_kernels(self):
        """The Triton elementwise kernels where these experts run their Triton bookkeeping (imported here:
        a CPU install may lack triton), else None."""
        if not self.triton:
            return None
        from sglang.srt.layers.moe import elementwise_triton

        return elementwise_triton

    def _routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        small = ids.numel() <= BATCHED_MAX_ASSIGNMENTS
        if x.device.type == "cpu":
            # Decode-size batches: grouped GEMMs, 1.2-1.5x faster than the padded block on CPU (tiny
            # preset shapes, one thread, 2 to 1,024 assignments), equal to it up to float32 rounding.
            if small and self.grouped_mm_applies(x):
                return self.forward_device(x, weights, ids)
        elif self.grouped_mm_applies(x) or small:
            return self.forward_device(x, weights, ids)
        # CPU, or a large float32/float16 batch on a device (prefill), where the padded block of
        # `forward_device` would cost E / k times the work: the host reads the counts (one sync).
        top_k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        # Other EP ranks' assignments (id num_experts) sort last and are cut off here: no row computes them.
        counts_t = torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts]
        counts = counts_t.tolist()
        assignments = sum(counts)
        order = order[:assignments]
        token_of = order // top_k
        weight_of = weights.reshape(-1)[order]
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        most = max(counts)
        if (
            0 < assignments <= BATCHED_MAX_ASSIGNMENTS
            and self.num_experts * most <= PADDING_LIMIT * assignments
        ):
            y = self._batched(x, flat[order], token_of, counts_t, most)
            out.index_add_(0, token_of, y.float() * weight_of[:, None])
            return out.to(x.dtype)
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            tokens = token_of[start : start + n]
            y = self._mlp(x[tokens], self.w13[expert].t(), self.w2[expert].t())
            out.index_add_(0, tokens, y.float() * weight_of[start : start + n, None])
            start += n
        return out.to(x.dtype)

    def forward_device(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, grouped: bool | None = None
    ) -> torch.Tensor:
        """`forward` without any device-to-host read (see the module docstring); runs on CPU too.
        `grouped`: grouped GEMMs or the padded block (default: grouped where `grouped_mm_applies`)."""
        use_grouped = self.grouped_mm_applies(x) if grouped is None else grouped
        # Three Triton launches for the bookkeeping instead of ~15 where they serve (sort_combine.py).
        sorted_ = sort_by_expert(ids, self.num_experts, self.triton and use_grouped)
        token_of, offs = sorted_.token_of, sorted_.offs
        if use_grouped:
            # Rows past offs[-1] (other EP ranks' assignments) belong to no group: the GEMMs leave them
            # uncomputed (unwritten memory), and the combine ignores them.
            h = torch._grouped_mm(x[token_of], self.w13.transpose(1, 2), offs=offs)
            y = torch._grouped_mm(self._activate(h), self.w2.transpose(1, 2), offs=offs)
        else:
            # Top-k experts of a token are distinct, so no expert gets more than num_tokens rows.
            expert_of = ids.reshape(-1)[sorted_.order]
            counts = torch.diff(offs, prepend=offs.new_zeros(1)).long()
            y = self._batched(x, expert_of, token_of, counts, ids.shape[0])
        return combine(y, sorted_, weights, x.dtype)

    def grouped_mm_applies(self, x: torch.Tensor) -> bool:
        """Grouped GEMMs take rows of a multiple of 16 bytes (on CPU and CUDA), and on an accelerator
        bfloat16 only (CUDA's kernels); on CPU any float dtype."""
        dims = (x.shape[1], self.intermediate_size)
        dtype_ok = x.device.type == "cpu" or x.dtype == torch.bfloat16
        return (
            x.dtype == self.w13.dtype
            and dtype_ok
            and hasattr(torch, "_grouped_mm")
            and all(d * x.element_size() % 16 == 0 for d in dims)
        )

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        if self.gated:
            gate, up = h.split(self.intermediate_size, dim=-1)
            k = self._elementwise_kernels() if self.act is F.silu and h.dim() == 2 else None
            return k.silu_mul(gate, up) if k is not None else self.act(gate) * up
        return self.act(h)

    def _mlp(self, x: torch.Tensor, w13_t: torch.Tensor, w2_t: torch.Tensor) -> torch.Tensor:
        return torch.matmul(self._activate(torch.matmul(x, w13_t)), w2_t)

    def _batched(
        self,
        x: torch.Tensor,
        expert_of: torch.Tensor,
        token_of: torch.Tensor,
        counts: torch.Tensor,
        most: int,
    ) -> torch.Tensor:
        """Every expert at once: the sorted assignments (expert `expert_of[i]`, token `token_of[i]`) fill
        rows of a zero-padded [E, most, H] block. Returns each sorted assignment's output, [T*k, H]; those
        of other EP ranks (expert E, sorted last) go to a spare slot that is not computed and read back as
        a computed row, which their weight 0 cancels."""
        e = self.num_experts
        first_row = torch.cumsum(counts, 0) - counts
        mine = expert_of < e
        local = torch.where(mine, expert_of, 0)
        row = torch.where(mine, torch.arange(expert_of.numel(), device=x.device) - first_row[local], 0)
        block = x.new_zeros(e + 1, most, x.shape[1])
        block[torch.where(mine, expert_of, e), row] = x[token_of]
        y = self._mlp(block[:e], self.w13.transpose(1, 2), self.w2.transpose(1, 2))
        return y[local, row]
