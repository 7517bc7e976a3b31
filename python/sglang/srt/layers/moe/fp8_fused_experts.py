"""`Fp8FusedExperts`: the shared expert run as one more expert of block-FP8 routed experts (the
`fused_gemms` of a `RoutedExperts` whose weights are FP8: Qwen3-Next's and Qwen3.5-MoE's FP8 checkpoints,
whose shared experts are FP8 too), as `fused_moe_triton.FusedExperts` runs it for 16-bit experts.

Apart, the shared expert of an FP8 model is three `Fp8BlockLinear`s, each an activation quantization and
a block GEMM, with the activation, its gate's GEMM and the sigmoid-weighted add: nine launches per MoE
layer of a decode step besides the routed experts' (the census of tiny-qwen3-next in FP8 counted them).
Appended as expert E of stacks of the FP8 weights and their block scales, every token picking it once
more with its gate's sigmoid as the weight, it runs inside the routed experts' launches
(`fused_moe_fp8_triton.fused_experts_fp8`: one quantization of x, the two grouped GEMMs, the combine),
and with `shared_routing.SharedRouting` its gate is a row of the router's GEMM.

It applies where the shared expert has the routed experts' form (gated silu, no biases, plain FP8
linears of the experts' block size and this rank's width) and gate and up end on a scale block (the
intermediate size a multiple of the block: 512 in the published checkpoints), so every block of the
stack is the checkpoint's own, bytes and scales; elsewhere the shared expert runs beside them. The
parameters become views of the stacks (weight updates in place reach the kernels), as the 16-bit
stacks' do. On CPU (FP8 experts there only with SGLANG_FP8_EXPERTS=fp8: tests) the stacks run through
the experts' torch twin.
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.mlp import GatedMLP
from sglang.srt.layers.moe.fused_moe_triton import FusedExperts
from sglang.srt.layers.quantization.fp8 import Fp8BlockLinear


class Fp8FusedExperts(FusedExperts):
    """One FP8 `RoutedExperts` layer's stacks (`FusedExperts`' interface: `fuse_shared`, `forward`,
    `forward_picked`, `shared`), its GEMMs those of its FP8 experts on any batch."""

    def __init__(self, experts: nn.Module):
        # (`FusedExperts`' fields that have no use here: tiles come from `fused_moe_fp8_triton`'s table)
        self.table, self.stack_table, self.max_tokens, self.relu2 = {}, {}, None, False
        self.silu_mul = experts.gated and experts.act is F.silu
        self.shared: tuple[nn.Module, nn.Module | None] | None = None
        # (w13, its scales, w2, its scales) of E + 1 experts
        self.stack: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def serves(self, experts: nn.Module, x: torch.Tensor) -> bool:
        return True  # (the FP8 experts' kernels, or their twin, take every batch)

    def fuse_shared(self, experts: nn.Module, mlp: nn.Module, gate: nn.Module | None) -> None:
        """Append `mlp` (and its [1, H] sigmoid `gate`, or None) as expert E where it fits (module
        docstring); else leave it beside the routed experts."""
        if self.shared is not None:
            if self.shared != (mlp, gate):
                raise ValueError("This layer's fused experts already run another shared expert.")
            return
        w13, w2 = experts.w13.data, experts.w2.data
        s13, s2 = experts.w13_weight_scale_inv.data, experts.w2_weight_scale_inv.data
        block = tuple(getattr(experts, "weight_block_size", None) or (128, 128))
        e, rows, hidden = w13.shape
        inter = rows // 2
        linears = (mlp.gate_proj, mlp.up_proj, mlp.down_proj) if isinstance(mlp, GatedMLP) else ()
        fits = (
            self.silu_mul and mlp.act is F.silu and len(linears) == 3 and inter % block[0] == 0
            and (gate is None or getattr(gate, "bias", None) is None)
            and all(
                type(lin) is Fp8BlockLinear and "forward" not in lin.__dict__ and lin.bias is None
                and not lin.reduce_results and lin.block == block and lin.weight.device == w13.device
                for lin in linears
            )
            and linears[0].weight.shape == linears[1].weight.shape == (inter, hidden)
            and linears[2].weight.shape == w2.shape[1:]
            and 2 * linears[0].weight_scale_inv.shape[0] == s13.shape[1]
            and linears[0].weight_scale_inv.shape[1:] == s13.shape[2:]
            and linears[2].weight_scale_inv.shape == s2.shape[1:]
        )  # fmt: skip
        if not fits:
            return
        gate_proj, up_proj, down_proj = linears
        stack13 = torch.cat([w13, torch.cat([gate_proj.weight.data, up_proj.weight.data])[None]])
        stack13_s = torch.cat(
            [s13, torch.cat([gate_proj.weight_scale_inv.data, up_proj.weight_scale_inv.data])[None]]
        )
        stack2, stack2_s = (
            torch.cat([w2, down_proj.weight.data[None]]),
            torch.cat([s2, down_proj.weight_scale_inv.data[None]]),
        )
        experts.w13.data, experts.w13_weight_scale_inv.data = stack13[:e], stack13_s[:e]
        experts.w2.data, experts.w2_weight_scale_inv.data = stack2[:e], stack2_s[:e]
        half = inter // block[0]
        gate_proj.weight.data, up_proj.weight.data = stack13[e, :inter], stack13[e, inter:]
        gate_proj.weight_scale_inv.data, up_proj.weight_scale_inv.data = (
            stack13_s[e, :half],
            stack13_s[e, half:],
        )
        down_proj.weight.data, down_proj.weight_scale_inv.data = stack2[e], stack2_s[e]
        self.stack, self.shared = (stack13, stack13_s, stack2, stack2_s), (mlp, gate)
        # (the old storages back to the device at once, as `FusedExperts.fuse_shared` says why)
        if stack13.is_cuda and threading.current_thread() is threading.main_thread():
            del w13, w2, s13, s2
            torch.cuda.empty_cache()

    def routed(
        self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return routed_fp8(experts, x, weights, ids)

    def forward_picked(
        self, experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
    ) -> torch.Tensor:
        return routed_fp8(experts, x, weights, ids, self.stack)


def routed_fp8(
    experts: nn.Module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, stack: tuple | None = None
) -> torch.Tensor:
    """FP8 `experts` on x with routing `weights` / `ids`: the Triton kernels where the experts' Triton
    path serves (CUDA), else their torch twin (`fused_moe_fp8_triton.py`). `stack`: (w13, its scales, w2,
    its scales) to run instead of the layer's own (`Fp8FusedExperts`' with the shared expert)."""
    if stack is None:
        scales = [getattr(experts, f"{w}_weight_scale_inv", None) for w in ("w13", "w2")]
        stack = (experts.w13, scales[0], experts.w2, scales[1])
    if stack[1] is None or stack[3] is None:
        raise ValueError("FP8 experts need w13_weight_scale_inv and w2_weight_scale_inv (block scales).")
    block = tuple(getattr(experts, "weight_block_size", None) or (128, 128))
    args = (x, *stack, weights, ids, experts._activate, block)
    if experts.triton:
        from sglang.srt.layers.moe.fused_moe_fp8_triton import fused_experts_fp8

        return fused_experts_fp8(*args, silu_and_mul=experts.gated and experts.act is F.silu)
    from sglang.srt.layers.moe.fused_moe_fp8_triton import fused_experts_fp8_torch

    return fused_experts_fp8_torch(*args)
