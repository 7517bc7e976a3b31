"""`SharedRouting`: a MoE block's router and its shared expert's sigmoid gate as one GEMM and one routing
launch, where the fused GEMMs run the shared expert as expert E (`fused_moe_triton.FusedExperts`: CUDA's
default for 16-bit batches of up to `experts.FUSED_AUTO_MAX_TOKENS` tokens; `fp8_fused_experts` for
block-FP8 experts, every batch; Qwen3-Next, Qwen3.5-MoE and their MTP layers).

Without it, each MoE layer of a decode step runs, around the router's GEMM and its top-k, the shared
gate's GEMM, a cast, a sigmoid, a fill and two concatenations to append the shared expert as each token's
pick k + 1 (`FusedExperts.forward`): six launches of a few microseconds each, 24 of the 108 kernels of a
decode step at the 80B's layer mix (`benchmark/gpu/kernel_census.py`, tiny-qwen3-next, batch 1). Here the
router's [E, H] and the shared gate's [1, H] weights are rows of one [E + 1, H] stack
(`stacked_linears.py`), whose GEMM gives both, and the routing kernel appends the pick
(`routing_triton.softmax_topk_triton(shared_gate=True)`).

The block takes this path only where the fused GEMMs serve the batch and still run the shared expert
(LoRA unfuses it where an adapter changes one of its linears), and where nothing hooks the two gates (an
adapter on the router: the stacked GEMM would pass its hook by); else the routing and the experts' call
it always took.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.stacked_linears import DTYPES, hooked, stack_linear_weights


class SharedRouting:
    """One MoE block's stacked gates (`build` says where they apply)."""

    def __init__(
        self, gate: nn.Linear, shared_gate: nn.Linear, experts: nn.Module, shared_expert: nn.Module, stack: torch.Tensor
    ):
        self.gate, self.shared_gate = gate, shared_gate
        self.experts, self.shared_expert = experts, shared_expert
        self.num_experts = gate.weight.shape[0]
        self.stack = stack  # the two gates' rows (`stack_linear_weights`)

    @classmethod
    def build(
        cls, gate: nn.Module, shared_gate: nn.Module | None, experts: nn.Module, shared_expert: nn.Module
    ) -> SharedRouting | None:
        """After the experts' load (`fuse_shared_expert`): the stacked gates where the fused GEMMs took
        `shared_expert` with `shared_gate` as expert E of one rank's experts (no expert parallelism: other
        ranks' ids would need remapping), both gates of one 16-bit or float32 dtype (FP8 experts' gates
        are kept in the serving dtype), [E, H] and [1, H], and they stack (`stack_linear_weights`: plain
        linears, SGLANG_STACK_LINEARS on); else None. (A batch of another dtype than the gates' takes the
        routing apart: `serves`.)"""
        gemms = getattr(experts, "fused_gemms", None)
        if gemms is None or shared_gate is None or gemms.shared != (shared_expert, shared_gate):
            return None
        e = experts.num_experts
        if e != experts.global_num_experts or not experts.triton:  # (the routing kernel is Triton's)
            return None
        if gate.weight.shape[0] != e or shared_gate.weight.shape != (1, gate.weight.shape[1]):
            return None
        if not all(isinstance(g.weight, torch.Tensor) and g.weight.dtype in DTYPES for g in (gate, shared_gate)):
            return None  # (an FP8 gate: its stack would not be a weight F.linear takes)
        stack = stack_linear_weights([gate, shared_gate])
        return None if stack is None else cls(gate, shared_gate, experts, shared_expert, stack)

    def serves(self, x: torch.Tensor) -> bool:
        gemms = self.experts.fused_gemms
        return (
            not hooked(self.gate, self.shared_gate)
            and x.dtype == self.stack.dtype
            and gemms is not None
            and gemms.shared == (self.shared_expert, self.shared_gate)
            and gemms.serves(self.experts, x)
        )

    def forward(self, x: torch.Tensor, top_k: int, renormalize: bool) -> torch.Tensor:
        """The routed experts and the shared expert for x [T, H] (this rank's part of the sum under
        tensor parallelism): the stacked GEMM, one routing launch, the fused GEMMs over E + 1 experts."""
        # (imported here: a CPU install may lack triton)
        from sglang.srt.layers.moe.routing_triton import softmax_topk_triton

        logits = F.linear(x, self.stack)[:, : self.num_experts + 1]
        weights, ids = softmax_topk_triton(logits, top_k, renormalize, shared_gate=True)
        experts = self.experts
        if experts.routing_capture is not None:
            experts.routing_capture.record(experts.routing_layer, ids[:, :top_k])
        return experts.fused_gemms.forward_picked(experts, x, weights, ids)
