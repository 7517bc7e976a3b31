"""The Mamba2 mixer of the hybrid models (Nemotron-H's, Granite-4.0-H's, Falcon-H1's; transformers'
`BambaMixer`): `in_proj` to [gate | x B C | dt], a causal conv over x B C, the SSD scan (the backend's),
a grouped gated RMSNorm (or, without one, `* silu(gate)`) and `out_proj`. Parameter names follow the
checkpoints (`in_proj`, `conv1d`, `dt_bias`, `A_log`, `D`, `norm`, `out_proj`); a model builds it from its
config's own field names."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.layers.layernorm import GroupedGatedRMSNorm
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
        norm: nn.Module | None = None,
        out_proj_bias: bool | None = None,
    ):
        """`norm`: the output norm taking (y, gate); default Nemotron-H's (gate first, groups of
        `num_heads * head_dim / n_groups`). `out_proj_bias`: default `proj_bias` (Falcon-H1 names its own)."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.head_dim = num_heads, head_dim
        self.n_groups, self.ssm_state_size = n_groups, state_size
        self.intermediate_size = num_heads * head_dim
        # dt = softplus(dt + dt_bias) is clamped to at least this (the backend's rule).
        self.time_step_min = float(time_step_min)
        self.conv_dim = self.intermediate_size + 2 * n_groups * state_size
        self.conv1d = nn.Conv1d(
            self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias
        )
        self.in_proj = nn.Linear(
            hidden_size, self.intermediate_size + self.conv_dim + num_heads, bias=proj_bias
        )
        self.dt_bias = nn.Parameter(torch.ones(num_heads))
        self.A_log = nn.Parameter(torch.zeros(num_heads))
        self.D = nn.Parameter(torch.ones(num_heads))
        if norm is None:
            norm = GroupedGatedRMSNorm(self.intermediate_size, self.intermediate_size // n_groups, eps=eps)
        self.norm = norm
        out_bias = proj_bias if out_proj_bias is None else out_proj_bias
        self.out_proj = nn.Linear(self.intermediate_size, hidden_size, bias=out_bias)

    def forward(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        gate, xBC, dt = self.in_proj(hidden).split(
            [self.intermediate_size, self.conv_dim, self.num_heads], dim=-1
        )
        y = fb.attn_backend.forward_linear(self, fb, xBC, dt)
        y = self.norm(y.reshape(hidden.shape[0], -1).to(hidden.dtype), gate)
        return self.out_proj(y)


class SiluGate(nn.Module):
    """The output gate of a Mamba2 mixer without a norm (Falcon-H1 without `mamba_rms_norm`)."""

    def forward(self, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return (y.float() * F.silu(gate.float())).to(y.dtype)
