"""flash-linear-attention's chunk layout of a packed batch, built on the host.

FLA's chunked kernels over variable-length sequences (`cu_seqlens`) take two index tensors: per chunk of
the batch (sequence by sequence, `chunk` tokens each, a sequence's last one shorter) the pair (sequence,
chunk within it), `chunk_indices` [NT, 2]; and the first chunk of each sequence, `chunk_offsets` [N + 1]
(the total last). Left to build them itself from a device `cu_seqlens`, FLA 0.6.0 syncs the host with
the device: `prepare_chunk_indices` copies its host-built result to the device with a blocking copy
(or reads `counts.sum()` back without the host copy of `cu_seqlens`), and `chunk_fwd_h` reads the
number of chunks back with `.item()`; one or two syncs per linear-attention layer of every extend.
Built here from the host's `cu_seqlens`, they travel in the batch's one copy
(`MambaAttnBackendBase.prepare_host_metadata`), and the number of chunks is a host int (their length).
"""

from __future__ import annotations

import itertools

import torch

from sglang.srt.utils.host_tensors import host_int64, move_to_device


def chunk_offsets(cu_seqlens: list[int], chunk: int) -> list[int]:
    """Index of each sequence's first chunk in a packed batch, the total last: also where its chunk
    states start among a packed kernel's (`linear/gdn_varlen.py`, `mamba/ssd_varlen.py`)."""
    out = [0]
    for a, b in itertools.pairwise(cu_seqlens):
        out.append(out[-1] + -(-(b - a) // chunk))
    return out


def chunk_layout_host(
    cu_seqlens: list[int], chunk: int, offsets: list[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk_indices [NT, 2], chunk_offsets [N + 1]) as int64 host tensors, FLA's definitions;
    `offsets`: `chunk_offsets(cu_seqlens, chunk)` where the caller has it."""
    offsets = offsets if offsets is not None else chunk_offsets(cu_seqlens, chunk)
    pairs = [x for seq, (a, b) in enumerate(itertools.pairwise(offsets)) for c in range(b - a) for x in (seq, c)]
    return host_int64(pairs).view(-1, 2), host_int64(offsets)


def chunk_layout(cu_seqlens: list[int], chunk: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_layout_host` on `device`, in one non-blocking copy (for callers without a batch to
    carry them, e.g. the kernel benchmarks)."""
    indices, offsets = move_to_device(chunk_layout_host(cu_seqlens, chunk), device)
    return indices, offsets
