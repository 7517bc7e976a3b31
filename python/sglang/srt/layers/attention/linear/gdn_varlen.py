"""Gated DeltaNet over a whole variable-length extend batch at once, with the states the cache takes
snapshots from: flash-linear-attention's chunked kernels on CUDA (`chunk_gdn_varlen_fla`) and their
torch twin (`chunk_gdn_varlen_torch`, per sequence, the CPU tests' stand-in through the same backend
path).

The contract both keep, for N sequences packed along T (`cu_seqlens` [N + 1]):
- inputs: q, k [T, Hk, K] (l2-normalised, q scaled), v [T, Hv, V], g (log-decay), beta [T, Hv] float32,
  initial states [N, Hv, V, K] float32 (the pool's layout); value head j reads key head j // (Hv / Hk);
- returns (out [T, Hv, V], final states [N, Hv, V, K] float32, chunk states [sum_i ceil(len_i / C), Hv,
  V, K]): chunk state `chunk_offsets(cu)[i] + c` (`layers/attention/fla_chunks.py`) is sequence i's
  state at the START of its chunk c, i.e. after c * C of its tokens, which is the cache's intermediate
  snapshot index c;
- optional FLA chunk layout of the batch (`chunk_indices`, `chunk_offsets` on the device), which the
  FLA path reads instead of building it (building it costs a host sync per layer).

FLA's public `chunk_gated_delta_rule` does not return the chunk states, so the FLA path runs its four
forward steps (cumsum of the gates, intra-chunk WY transform, chunk-to-chunk states, outputs), a recipe
checked on an H100 against the public call (`../shared/reference/gpu.md`). FLA stores chunk states in
the inputs' dtype (bfloat16 snapshots from bfloat16 inputs) and runs its dots in TF32 (IEEE for
float32 models: `layers/attention/fla_float32.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.attention.fla_chunks import chunk_layout
from sglang.srt.layers.attention.linear.gated_delta_rule import chunk_gated_delta_rule

logger = logging.getLogger(__name__)


def chunk_gdn_varlen_fla(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: list[int],
    chunk_size: int,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
    kernel_state_v_first: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`chunk_indices` / `chunk_offsets`: FLA's chunk layout of the batch on the device, as the backend
    moves it with the batch (`layers/attention/fla_chunks.py`); built and copied here when not given.
    Given both, nothing here or in FLA's kernels' wrappers waits for the device.

    `kernel_state_v_first` False (the default) runs FLA's kernels in their own [K, V] state layout: the
    initial states go in transposed (one copy) and the states come back as transposed views, so the
    contract's [V, K] holds either way. True runs them in the pool's [V, K] layout. On an H200 at
    Qwen3-Next-80B's shapes the state pass and the whole call were faster in [K, V], the transpose
    included (benchmark/gpu/README.md, fourth session)."""
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    dtype = v.dtype if v.dtype in (torch.float32, torch.bfloat16, torch.float16) else torch.float32
    q, k, v = (t.to(dtype).unsqueeze(0).contiguous() for t in (q, k, v))
    g, beta = (t.float().unsqueeze(0).contiguous() for t in (g, beta))
    if chunk_indices is None or chunk_offsets is None:
        chunk_indices, chunk_offsets = chunk_layout(cu_seqlens_cpu, chunk_size, v.device)
    common = dict(cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    # The kernels use exp2: gates are cumulated per chunk and scaled by 1 / ln 2.
    g = chunk_local_cumsum(g, scale=RCP_LN2, chunk_indices=chunk_indices, **common)
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k, v=v, g=g, beta=beta, chunk_indices=chunk_indices, **common)
    h0 = initial_states.float() if kernel_state_v_first else initial_states.float().transpose(-1, -2)
    h, v_new, final = chunk_gated_delta_rule_fwd_h(
        k=k,
        w=w,
        u=u,
        g=g,
        initial_state=h0.contiguous(),
        output_final_state=True,
        state_v_first=kernel_state_v_first,
        chunk_indices=chunk_indices,
        chunk_offsets=chunk_offsets,
        **common,
    )
    out = chunk_fwd_o(
        q=q, k=k, v=v_new, h=h, g=g, scale=1.0, state_v_first=kernel_state_v_first, chunk_indices=chunk_indices,
        **common,
    )  # fmt: skip
    if kernel_state_v_first:
        return out[0], final, h[0]
    return out[0], final.transpose(-1, -2), h[0].transpose(-1, -2)


def chunk_gdn_varlen_torch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_states: torch.Tensor,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: list[int],
    chunk_size: int,
    chunk_indices: torch.Tensor | None = None,
    chunk_offsets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The contract in torch, one sequence at a time (`chunk_gated_delta_rule`); FLA's chunk layout
    is not needed."""
    group = v.shape[1] // k.shape[1]
    q, k = q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)
    out = torch.empty(v.shape, dtype=torch.float32, device=v.device)
    finals, chunks = [], []
    for i, (a, b) in enumerate(zip(cu_seqlens_cpu, cu_seqlens_cpu[1:], strict=False)):
        o, final, inter = chunk_gated_delta_rule(
            q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], initial_states[i], chunk_size, return_intermediate=True
        )
        out[a:b] = o
        finals.append(final)
        chunks.append(inter[: -(-(b - a) // chunk_size)])
    return out, torch.stack(finals), torch.cat(chunks)


def gdn_varlen_impl(device: torch.device) -> Callable | None:
    """The packed-batch extend `SGLANG_GDN_EXTEND_BACKEND` asks for on `device`, or None (per request):
    auto takes FLA on CUDA where it imports."""
    choice = envs.SGLANG_GDN_EXTEND_BACKEND.get()
    if choice not in ("auto", "torch", "fla", "torch_varlen"):
        raise ValueError(f"SGLANG_GDN_EXTEND_BACKEND must be auto, torch, fla or torch_varlen; got {choice!r}.")
    if choice == "torch_varlen":
        return chunk_gdn_varlen_torch
    if choice == "fla" or (choice == "auto" and device.type == "cuda"):
        try:
            import fla.ops.common.chunk_delta_h  # noqa: F401
        except Exception as e:  # noqa: BLE001 - no usable FLA: the torch form serves
            if choice == "fla":
                raise
            logger.warning(
                "flash-linear-attention is unavailable (%s): Gated DeltaNet prefill runs the torch form, "
                "one request at a time; pip install fla-core for the fast path.",
                e,
            )
            return None
        return chunk_gdn_varlen_fla
    return None
