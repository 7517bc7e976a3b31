"""Mamba2 state-space duality (SSD) scan and single-token update, pure torch, float32.

Per head h with state S [P, N] (pool layout), time step dt_t > 0 and A_h < 0:
    S_t = exp(dt_t A_h) S_{t-1} + dt_t x_t B_t^T,    y_t = S_t C_t + D_h x_t.
The chunked scan computes each chunk's intra-chunk part as a masked (decayed) attention and passes the
state from chunk to chunk; only that pass is sequential. B and C arrive already expanded to the heads,
dt already biased, softplus-ed and clamped.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int,
    return_intermediate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One sequence: x [E, H, P], dt [E, H], A, D [H], B, C [E, H, N], initial_state [H, P, N].

    Returns (y [E, H, P], final state [H, P, N], intermediates [E // chunk_size + 1, H, P, N] or None),
    where intermediates[i] is the state after i * chunk_size tokens (index 0 = the initial state)."""
    length = x.shape[0]
    pad = -length % chunk_size
    x32 = x.float()
    # Padding tokens have dt = 0: no decay and no write.
    xp, Bp, Cp = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (x32, B, C))
    dtp = F.pad(dt.float(), (0, 0, 0, pad))
    n = (length + pad) // chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, n, C, ...]
        return t.view(n, chunk_size, *t.shape[1:]).movedim(2, 0)

    x_dt = chunks(xp * dtp[..., None])
    Bc, Cc = chunks(Bp), chunks(Cp)
    cum = chunks(dtp * A.float()[None]).cumsum(dim=-1)  # [H, n, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=x.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()

    y = ((Cc @ Bc.transpose(-1, -2)) * decay) @ x_dt  # intra-chunk [H, n, C, P]
    to_end = (cum[..., -1:] - cum).exp()
    chunk_states = x_dt.transpose(-1, -2) @ (Bc * to_end[..., None])  # [H, n, P, N]
    chunk_decay = cum[..., -1].exp()  # [H, n]

    state = initial_state.float()
    entering = []
    for c in range(n):
        entering.append(state)
        state = state * chunk_decay[:, c, None, None] + chunk_states[:, c]
    entering_states = torch.stack(entering, dim=1)  # [H, n, P, N]
    y = y + (Cc @ entering_states.transpose(-1, -2)) * cum.exp()[..., None]
    y = y.flatten(1, 2)[:, :length].transpose(0, 1) + D.float()[None, :, None] * x32
    inter = None
    if return_intermediate:
        full = length // chunk_size
        inter = torch.cat([entering_states.transpose(0, 1), state[None]])[: full + 1]
    return y, state, inter


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of bs sequences: state [bs, H, P, N], x [bs, H, P], dt [bs, H], B, C
    [bs, H, N]. Returns (y [bs, H, P], new state), float32."""
    dt = dt.float()
    x = x.float()
    s = state.float() * (dt * A.float()[None]).exp()[..., None, None]
    s = s + (dt[..., None] * x)[..., :, None] * B.float()[:, :, None, :]
    y = (s @ C.float()[..., None])[..., 0] + D.float()[None, :, None] * x
    return y, s
