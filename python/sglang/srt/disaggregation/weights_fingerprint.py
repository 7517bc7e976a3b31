"""A fingerprint of the weights a server computes with, so that a prefill/decode pair serving different
values (another checkpoint of the same shapes, a fine-tune; a weight update applied to one server only)
is refused instead of continuing one server's KV and state with the other's weights.

What it reads: every tensor of the model's state dict (parameters and persistent buffers, the MTP layer's
too) as it is in memory after load, on its own device: no file is read again. Each tensor's bytes are
taken as int64 words (its bits, whatever the dtype) on a grid 4 KiB wide and reduced to a few int64 sums:
all words, the grid rows' sums weighted by row index and the columns' sums weighted by column index, so
that a changed value, even by one bit, and values moved within the tensor both change it. Integer sums wrap
modulo 2**64 and do not depend on the reduction's order, so the same values give the same fingerprint on
any device, thread count or GPU; float sums would not. The names, shapes, dtypes and sums go into one
SHA-256. Cost: two reads of the weights at memory speed (docs/disaggregation.md has the numbers), on PD
servers only, at start and after each weight update.

Under --tp-size N each rank fingerprints its own shard; a prefill rank's is checked against the decode
rank's of the same index, which holds the same shard when the two servers hold the same weights.
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sglang.srt.disaggregation.transfer import PoolLayout

logger = logging.getLogger(__name__)

# The bits are read as int64 words on a grid this many words (4 KiB) wide: int64 sums run at memory speed
# (on CPU ~30x faster than summing int16 or int32 into int64, which torch does element by element).
GRID_WORDS = 512


def _weighted(v: torch.Tensor) -> torch.Tensor:
    return (v * torch.arange(1, v.numel() + 1, device=v.device, dtype=torch.int64)).sum()


def _tensor_sums(t: torch.Tensor) -> list[torch.Tensor]:
    """Int64 sums of `t`'s bits (0-dim tensors on its device): its bytes as int64 words on a grid
    `GRID_WORDS` wide, all of them, its rows' sums by row index and its columns' by column index; the words
    past the last full row and the bytes past the last word, each by position."""
    # In logical order, not memory order: the CPU keeps MoE experts transposed (`experts.py`), a GPU does
    # not, and equal values must fingerprint alike (the copy is the CPU's, of its transposed experts).
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)
    whole = data.numel() // 8 * 8
    try:
        words = data[:whole].view(torch.int64)
    except RuntimeError:  # (a view whose start is not 8-byte aligned: an aligned copy)
        words = data[:whole].clone().view(torch.int64)
    full = words.numel() // GRID_WORDS * GRID_WORDS
    grid = words[:full].view(-1, GRID_WORDS)
    rows = grid.sum(dim=1)
    return [
        rows.sum(),
        _weighted(rows),
        _weighted(grid.sum(dim=0)),
        _weighted(words[full:]),
        _weighted(data[whole:].to(torch.int64)),
    ]


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
    try:
        digest = weights_fingerprint(runner.model, getattr(runner, "draft_model", None))
    except Exception as e:  # noqa: BLE001 - (out of memory for a copy, say) after an update that succeeded
        # Not a crash of the scheduler, and no match with any peer: this server's pair refuses.
        digest = f"not computed ({type(e).__name__}, {uuid.uuid4().hex[:8]})"
        logger.warning("The weights' fingerprint could not be computed (%r): PD pairs will refuse.", e)
    logger.info(
        "Weights fingerprint %s (%s), computed in %.1f ms.", digest, model_path, (time.perf_counter() - start) * 1e3
    )
    return replace(
        layout,
        weights=f"--dtype {runner.dtype}, --quantization {args.quantization or 'none'}",
        weights_digest=digest,
        weights_source=f"model {model_path}, weight version {args.weight_version}",
    )
