"""Dense MLPs: gated (`down(act(gate(x)) * up(x))`, Qwen3-Next) and plain (`down(act(up(x)))`,
Nemotron-H with relu2). Parameter names follow the HF checkpoints.

Tensor parallel: gate / up column-parallel, down row-parallel (one all-reduce, or none with
`reduce_results=False`: a MoE's shared expert, summed with the routed experts' part once)."""

from __future__ import annotations

import torch
from torch import nn

from sglang.srt.layers.activation import get_act_fn
from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "silu",
        bias: bool = False,
        reduce_results: bool = True,
    ):
        super().__init__()
        what = "the MLP's intermediate size"
        self.gate_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, what=what)
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, what=what)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results, what=what
        )
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act: str = "relu2",
        bias: bool = False,
        reduce_results: bool = True,
    ):
        super().__init__()
        what = "the MLP's intermediate size"
        self.up_proj = ColumnParallelLinear(hidden_size, intermediate_size, bias=bias, what=what)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results, what=what
        )
        self.act = get_act_fn(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))
