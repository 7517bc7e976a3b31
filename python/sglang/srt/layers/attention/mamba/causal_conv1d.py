"""Depthwise causal conv1d with a carried state, for the linear-attention layers (GDN and Mamba2).

The state is the last K-1 conv *inputs* of a sequence, laid out `[channels, K-1]` (window last). An
extend prepends the state to its inputs, so output t sees inputs t-K+1..t; the returned window
`[K-1+E, channels]` holds state and inputs in position order, so rows j..j+K-2 are the K-1 inputs
before offset j of the extend (the state a snapshot after j tokens must hold).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv1d_extend(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [E, C], state [C, K-1], weight [C, K]. Returns (silu(conv) [E, C], window [K-1+E, C]), both
    float32: the inputs are convolved as given and rounded only where the window is stored. `silu`
    False: the plain conv (LFM2's short conv)."""
    window = torch.cat([state.t().float(), x.float()], dim=0)
    channels = x.shape[1]
    b = None if bias is None else bias.float()
    out = F.conv1d(window.t().float()[None], weight.float()[:, None, :], b, groups=channels)[0]
    return (F.silu(out.t()) if silu else out.t()), window


def causal_conv1d_update(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence: x [bs, C], state [bs, C, K-1]. Returns (silu(conv) [bs, C] float32,
    new state [bs, C, K-1] in the state's dtype). As in the extend, the current input enters the
    convolution unrounded; only the stored state takes the state's dtype."""
    full = torch.cat([state.float(), x.float()[:, :, None]], dim=-1)
    out = (full * weight.float()[None]).sum(-1)
    if bias is not None:
        out = out + bias.float()
    return (F.silu(out) if silu else out), full[:, :, 1:].to(state.dtype)
