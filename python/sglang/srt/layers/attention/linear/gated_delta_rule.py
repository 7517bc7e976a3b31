"""Gated delta rule (Gated DeltaNet), pure torch, float32.

Per head, with state S [V, K] (pool layout: v ~ S k), log-decay g_t and write strength beta_t:
    S_t = exp(g_t) S_{t-1} + beta_t (v_t - exp(g_t) S_{t-1} k_t) k_t^T,    o_t = S_t q_t.
The chunked form processes `chunk_size` tokens at once: inside a chunk the delta-rule writes are
condensed by a unit-lower-triangular solve (the WY/UT transform), and only the chunk-to-chunk state
pass is sequential. Inputs arrive already expanded to the value heads; q and k l2-normalised, q scaled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor,
    chunk_size: int,
    return_intermediate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One sequence: q, k [E, H, K], v [E, H, V], g, beta [E, H], initial_state [H, V, K].

    Returns (out [E, H, V], final state [H, V, K], intermediates [E // chunk_size + 1, H, V, K] or None),
    where intermediates[i] is the state after i * chunk_size tokens (index 0 = the initial state)."""
    length = q.shape[0]
    pad = -length % chunk_size
    # Padding tokens have k = 0 and g = 0: they neither decay nor write the state.
    q, k, v = (F.pad(t.float(), (0, 0, 0, 0, 0, pad)) for t in (q, k, v))
    g, beta = (F.pad(t.float(), (0, 0, 0, pad)) for t in (g, beta))
    n = (length + pad) // chunk_size

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [L, H, ...] -> [H, n, C, ...]
        return t.view(n, chunk_size, *t.shape[1:]).movedim(2, 0)

    q, k, v, g, beta = (chunks(t) for t in (q, k, v, g, beta))
    cum = g.cumsum(dim=-1)  # [H, n, C]
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()

    k_beta = k * beta[..., None]
    # (I + A) with A[t, s] = beta_t (k_t . k_s) exp(c_t - c_s) for s < t; the solver reads only the
    # strictly lower part and takes the diagonal as 1.
    system = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    intra = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()  # [H, n]

    state = initial_state.float().transpose(-1, -2)  # [H, K, V] for the chunk algebra
    outs = []
    inter = [state] if return_intermediate else None
    for c in range(n):
        v_new = u[:, c] - w[:, c] @ state
        outs.append(q_decayed[:, c] @ state + intra[:, c] @ v_new)
        state = state * chunk_decay[:, c, None, None] + k_to_end[:, c].transpose(-1, -2) @ v_new
        if inter is not None and (c + 1) * chunk_size <= length:
            inter.append(state)
    out = torch.stack(outs, dim=1).flatten(1, 2)[:, :length].transpose(0, 1)  # [E, H, V]
    final = state.transpose(-1, -2)
    stacked = None if inter is None else torch.stack(inter).transpose(-1, -2)
    return out, final, stacked


def recurrent_gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for each of bs sequences: q, k [bs, H, K], v [bs, H, V], g, beta [bs, H],
    state [bs, H, V, K]. Returns (out [bs, H, V], new state [bs, H, V, K]), float32."""
    s = state.float() * g.float().exp()[..., None, None]
    k, q = k.float(), q.float()
    predicted = (s @ k[..., None])[..., 0]
    delta = (v.float() - predicted) * beta.float()[..., None]
    s = s + delta[..., :, None] * k[..., None, :]
    return (s @ q[..., None])[..., 0], s
