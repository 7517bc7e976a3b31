"""The Mamba2 mixer of the hybrid models (Nemotron-H's, Granite-4.0-H's, Falcon-H1's; transformers'
`BambaMixer`): `in_proj` to [gate | x B C | dt], a causal conv over x B C, the SSD scan (the backend's),
a grouped gated RMSNorm (or, without one, `* silu(gate)`) and `out_proj`. Parameter names follow the
checkpoints (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`); a model builds it from its
config's own field names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.attention.mamba.mamba2_shards import Mamba2Shards
from sglang.srt.layers.layernorm import GroupedGatedRMSNorm, SplitGroupGatedRMSNorm
from sglang.srt.layers.linear import RowParallelLinear, set_weight_shards
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class Mamba2Mixer(nn.Module):
    def __init__(
        self,
        layer_id: int,
        hidden_size: int,
        *,
        num_heads: int,
        head_dim: int,
        n_groups: int,
        state_size: int,
        conv_kernel: int,
        conv_bias: bool,
        proj_bias: bool,
        eps: float,
        time_step_min: float,
        norm: str = "gate_first",
        out_proj_bias: bool | None = None,
        reduce_results: bool = True,
    ):
        """Sizes are the whole mixer's; the module holds this TP rank's part (`Mamba2Shards`), and its
        `num_heads`, `n_groups`, `intermediate_size` and `conv_dim` are the local ones the backend reads.
        `norm`: the output norm over groups of `num_heads * head_dim / n_groups` channels, "gate_first"
        (Nemotron-H's) or "gate_after" (Falcon-H1's `mamba_norm_before_gate`), or "none" (the gate
        alone). `out_proj_bias`: default `proj_bias` (Falcon-H1 names its own). `reduce_results` False:
        the output is this rank's part of the sum (Falcon-H1 adds it to its attention's and reduces once)."""
        super().__init__()
        self.layer_id = layer_id
        self.shards = shards = Mamba2Shards.for_this_rank(num_heads, head_dim, n_groups, state_size)
        self.num_heads, self.head_dim = shards.local_heads, head_dim
        self.n_groups, self.ssm_state_size = shards.local_groups, state_size
        self.intermediate_size = shards.local_intermediate
        # dt = softplus(dt + dt_bias) is clamped to at least this (the backend's rule).
        self.time_step_min = float(time_step_min)
        self.conv_dim = self.intermediate_size + 2 * self.n_groups * state_size
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias
        )
        self.in_proj = nn.Linear(
            hidden_size, self.intermediate_size + self.conv_dim + self.num_heads, bias=proj_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(self.num_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_heads))
        self.D = nn.Parameter(torch.ones(self.num_heads))
        self.norm = _output_norm(shards, norm, eps)
        # The loader gives each parameter the checkpoint's whole tensor; these say which rows are ours.
        in_rows, conv_rows = shards.dim_shard("in_proj_spans"), shards.dim_shard("conv_spans")
        heads, channels = shards.dim_shard("head_spans"), shards.dim_shard("channel_spans")
        for param, rows in [
            (self.in_proj.weight, in_rows), (self.in_proj.bias, in_rows),
            (self.conv1d.weight, conv_rows), (self.conv1d.bias, conv_rows),
            (self.dt_bias, heads), (self.A_log, heads), (self.D, heads),
            (getattr(self.norm, "weight", None), channels),
        ]:  # fmt: skip
            if param is not None:
                set_weight_shards(param, rows)
        out_bias = proj_bias if out_proj_bias is None else out_proj_bias
        self.out_proj = RowParallelLinear(
            shards.intermediate, hidden_size, bias=out_bias, reduce_results=reduce_results
        )

    def forward(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        gate, xBC, dt = self.in_proj(hidden).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        y = fb.attn_backend.forward_linear(self, fb, xBC, dt)
        y = self.norm(y.reshape(hidden.shape[0], -1).to(hidden.dtype), gate)
        return self.out_proj(y)


def _output_norm(shards: Mamba2Shards, kind: str, eps: float) -> nn.Module:
    if kind == "none":
        return SiluGate()
    gate_first = {"gate_first": True, "gate_after": False}[kind]
    local, group = shards.local_intermediate, shards.intermediate // shards.n_groups
    if local % group:  # a norm group spans several ranks
        return SplitGroupGatedRMSNorm(local, group, shards.n_groups, shards.first_group, eps, gate_first)
    return GroupedGatedRMSNorm(local, group, eps=eps, gate_first=gate_first)


class SiluGate(nn.Module):
    """The output gate of a Mamba2 mixer without a norm (Falcon-H1 without `mamba_rms_norm`)."""

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (y.float() * F.silu(gate.float())).to(y.dtype)
