"""A fingerprint of the weights a server computes with, so that a prefill/decode pair serving different
values (another checkpoint of the same shapes, a fine-tune; a weight update applied to one server only)
is refused instead of continuing one server's KV and state with the other's weights.

What it reads: every tensor of the model's state dict (parameters and persistent buffers, the MTP layer's
too) as it is in memory after load, on its own device: no file is read again. Each tensor's elements are
taken as integers of their width (their bits, whatever the dtype) and reduced to three int64 sums: all
elements, the rows' sums weighted by the row index and the columns' sums weighted by the column index
(the tensor seen as [first dim, rest] and [rest, last dim]), so that changed values and permuted rows or
columns all change it. Integer sums wrap modulo 2**64 and do not depend on the reduction's order, so the
same values give the same fingerprint on any device, thread count or GPU; float sums would not. The names,
shapes, dtypes and sums go into one SHA-256. Cost: two reads of the weights at memory bandwidth (measured
in docs/disaggregation.md), on PD servers only, at start and after each weight update.

Under --tp-size N each rank fingerprints its own shard; a prefill rank's is checked against the decode
rank's of the same index, which holds the same shard when the two servers hold the same weights.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang.srt.disaggregation.transfer import PoolLayout

logger = logging.getLogger(__name__)

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _tensor_sums(t: torch.Tensor) -> list[torch.Tensor]:
    """Three int64 sums of `t`'s bits (0-dim tensors on its device): its elements, its rows' sums by row
    index, its columns' sums by column index."""
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    if t.is_complex():
        t = torch.view_as_real(t)
    words = t.detach().contiguous().view(_INT_OF_WIDTH[t.element_size()])
    flat = words.reshape(-1)
    rows = words.reshape(words.shape[0], -1) if words.dim() > 1 else flat.reshape(-1, 1)
    cols = words.reshape(-1, words.shape[-1]) if words.dim() > 1 else flat.reshape(1, -1)
    row_sums, col_sums = rows.sum(dim=1), cols.sum(dim=0)  # (int64: integer sums promote)
    row_index = torch.arange(1, row_sums.numel() + 1, device=t.device, dtype=torch.int64)
    col_index = torch.arange(1, col_sums.numel() + 1, device=t.device, dtype=torch.int64)
    return [row_sums.sum(), (row_sums * row_index).sum(), (col_sums * col_index).sum()]


def weights_fingerprint(*models: torch.nn.Module | None) -> str:
    """The fingerprint of the models' weights (None entries skipped): 16 hex digits."""
    h = hashlib.sha256()
    sums: list[torch.Tensor] = []
    for i, model in enumerate(models):
        if model is None:
            continue
        for name, t in model.state_dict(keep_vars=True).items():
            if t is None or t.device.type == "meta" or t.numel() == 0:
                h.update(f"{i}:{name}:empty;".encode())
                continue
            h.update(f"{i}:{name}:{tuple(t.shape)}:{t.dtype};".encode())
            sums += _tensor_sums(t)
    if sums:  # (one copy to the host: the sums wait on the device until then)
        h.update(torch.stack([s.to(sums[0].device) for s in sums]).cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def with_weights(layout: PoolLayout, sched: Any, model_path: str) -> PoolLayout:
    """`layout` naming the weights `sched`'s model runner serves now: their dtype and quantization, their
    fingerprint, and where they came from (`model_path`: --model-path, or the last
    /update_weights_from_disk's; the weight version: --weight-version, or the last update's that named
    one)."""
    args, runner = sched.server_args, sched.model_runner
    start = time.perf_counter()
    digest = weights_fingerprint(runner.model, getattr(runner, "draft_model", None))
    logger.info(
        "Weights fingerprint %s (%s), computed in %.1f ms.", digest, model_path, (time.perf_counter() - start) * 1e3
    )
    return replace(
        layout,
        weights=f"--dtype {runner.dtype}, --quantization {args.quantization or 'none'}",
        weights_digest=digest,
        weights_source=f"model {model_path}, weight version {args.weight_version}",
    )
