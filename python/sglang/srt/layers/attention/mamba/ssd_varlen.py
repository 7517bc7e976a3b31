"""Mamba2's SSD over a whole variable-length extend batch at once, with the states the cache takes
snapshots from: flash-linear-attention's simple-gated-linear-attention kernels on CUDA
(`ssd_varlen_fla`) and their torch twin (`ssd_varlen_torch`, per sequence `ssd_chunk_scan`, the CPU
tests' stand-in through the same backend path).

SSD is simple gated linear attention: per head, q = C, k = B, v = x * dt, log-decay dt * A, scale 1, and
y = o + D * x; the state [H, P, N] is FLA's `state_v_first` layout, which is our pool's.

The contract both keep, for N sequences packed along T (`cu_seqlens` [N + 1]) and a state chunk S:
- inputs: x [T, H, P], dt [T, H] (biased, softplus'd, clamped), A, D [H], B, C [T, G, N] (group g
  serves heads g * H/G ...), initial states [N, H, P, N] float32;
- returns (y [T, H, P] float32, final states [N, H, P, N] float32, chunk states [sum_i ceil(len_i / S),
  H, P, N]): chunk state `chunk_offsets(cu, S)[i] + c` is sequence i's state after c * S of its tokens;
- optional FLA chunk layout (`chunk_indices`, `chunk_offsets`), as in `linear/gdn_varlen.py`.

The FLA path mirrors FLA's own `chunk_simple_gla_fwd` (gates cumulated per 64-token chunk in log2, the
chunk states, the output), with B and C expanded to every head (its state pass takes as many key heads
as value heads); S is FLA's chunk, 64, so it serves models whose state chunk is a multiple of 64.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.attention.fla_chunks import chunk_layout
from sglang.srt.layers.attention.mamba.ssd import ssd_chunk_scan

logger = logging.getLogger(__name__)

FLA_CHUNK = 64


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    return t.repeat_interleave(heads // t.shape[1], dim=1)


def ssd_varlen_fla(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: list[int],
    chunk_size: int,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_indices` / `chunk_offsets`: FLA's chunk layout on the device, as `chunk_gdn_varlen_fla`
    takes it; given both, nothing here waits for the device."""
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    assert chunk_size == FLA_CHUNK, "FLA's SSD runs 64-token chunks"
    heads = x.shape[1]
    dtype = x.dtype if x.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    dt = dt.float()
    v = (x.float() * dt[..., None]).to(dtype).unsqueeze(0).contiguous()
    q, k = (_heads(t, heads).to(dtype).unsqueeze(0).contiguous() for t in (C, B))
    g = (dt * A.float()[None]).unsqueeze(0).contiguous()
    if chunk_indices is None or chunk_offsets is None:
        chunk_indices, chunk_offsets = chunk_layout(cu_seqlens_cpu, chunk_size, x.device)
    common = dict(cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    # The kernels use exp2: gates are cumulated per chunk and scaled by 1 / ln 2.
    g = chunk_local_cumsum(g, scale=RCP_LN2, chunk_indices=chunk_indices, **common)
    h0 = initial_states.float().contiguous()
    h, final = _chunk_states(k, v, g, h0, cu_seqlens, chunk_offsets, chunk_indices.shape[0], chunk_size)
    # The states stay float32 (they are the cache's snapshots); the output's dots take them in q's dtype.
    o = chunk_fwd_o(
        q=q, k=k, v=v, g=g, h=h.to(dtype), scale=1.0, state_v_first=True, chunk_indices=chunk_indices, **common
    )
    y = o[0].float() + D.float()[None, :, None] * x.float()
    return y, final, h[0]


def _chunk_states(
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    h0: torch.Tensor,
    cu_seqlens: torch.Tensor,
    chunk_offsets: torch.Tensor,
    num_chunks: int,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLA 0.6.0's `chunk_fwd_h` (float32 states in the [V, K] layout, one at each chunk start, and the
    final ones) with the number of chunks given by the host (`chunk_indices`' length): `chunk_fwd_h`
    reads it back from the device with `.item()`, a sync per Mamba2 layer."""
    import triton
    from fla.ops.common.chunk_h import chunk_fwd_kernel_h

    _, t, heads, dk, dv = *k.shape, v.shape[-1]
    n = chunk_offsets.shape[0] - 1
    h = k.new_empty(1, num_chunks, heads, dv, dk, dtype=torch.float32)
    final = k.new_empty(n, heads, dv, dk, dtype=torch.float32)

    def grid(meta):
        return (triton.cdiv(dk, meta["BK"]) * triton.cdiv(dv, meta["BV"]) * n * heads,)

    chunk_fwd_kernel_h[grid](
        k=k, v=v, h=h, g=g, g_gamma=None, gk=None, gv=None, h0=h0, ht=final, cu_seqlens=cu_seqlens,
        split_offsets=chunk_offsets, T=t, H=heads, K=dk, V=dv, BT=chunk, BS=chunk, USE_G=True,
        USE_G_GAMMA=False, USE_GK=False, USE_GV=False, STATE_V_FIRST=True,
    )  # fmt: skip
    return h, final


def ssd_varlen_torch(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    initial_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: list[int],
    chunk_size: int,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract in torch, one sequence at a time (`ssd_chunk_scan`); FLA's chunk layout is not
    needed."""
    heads = x.shape[1]
    B, C = _heads(B, heads), _heads(C, heads)
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    finals, chunks = [], []
    for i, (a, b) in enumerate(zip(cu_seqlens_cpu, cu_seqlens_cpu[1:], strict=False)):
        out, final, inter = ssd_chunk_scan(
            x[a:b], dt[a:b], A, B[a:b], C[a:b], D, initial_states[i], chunk_size, return_intermediate=True
        )
        y[a:b] = out
        finals.append(final)
        n_chunks = -(-(b - a) // chunk_size)
        # `inter` holds the states after 0, S, 2S, ... up to the last full chunk: the chunk starts.
        chunks.append(inter[:n_chunks])
    return y, torch.stack(finals), torch.cat(chunks)


def ssd_varlen_impl(device: torch.device, kernel_state_chunk: int) -> tuple[Callable | None, int]:
    """The packed-batch extend `SGLANG_MAMBA2_EXTEND_BACKEND` asks for on `device` and the chunk of its
    states, or (None, _): per request. auto takes FLA on CUDA where it imports and its 64-token chunk
    divides the model's state chunk."""
    choice = envs.SGLANG_MAMBA2_EXTEND_BACKEND.get()
    if choice not in ("auto", "torch", "fla", "torch_varlen"):
        raise ValueError(
            f"SGLANG_MAMBA2_EXTEND_BACKEND must be auto, torch, fla or torch_varlen; got {choice!r}."
        )
    if choice == "torch_varlen":
        return ssd_varlen_torch, kernel_state_chunk
    if choice == "fla" or (choice == "auto" and device.type == "cuda"):
        reason = None
        if kernel_state_chunk % FLA_CHUNK:
            reason = f"the model's chunk size {kernel_state_chunk} is not a multiple of FLA's {FLA_CHUNK}"
        else:
            try:
                import fla.ops.common.chunk_h  # noqa: F401
            except Exception as e:  # noqa: BLE001 - no usable FLA: the torch form serves
                reason = f"flash-linear-attention is unavailable ({e})"
        if reason is None:
            return ssd_varlen_fla, FLA_CHUNK
        if choice == "fla":
            raise ValueError(f"SGLANG_MAMBA2_EXTEND_BACKEND=fla cannot serve: {reason}.")
        logger.warning("Mamba2 prefill runs the torch form, one request at a time: %s.", reason)
    return None, kernel_state_chunk
