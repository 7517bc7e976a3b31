"""`RadixAttention`: the full-attention call of a model layer; the batch's attention backend does the
work (it owns the KV pool access), as in SGLang."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int):
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.layer_id = layer_id
        # The checkpoint's per-layer float8 KV cache scales (upstream's names; None where it has none).
        self.k_scale: float | None = None
        self.v_scale: float | None = None
        # What the KV pool stores K and V divided by, and the backends multiply back: resolved once for
        # the pool's dtype at start and after a weight update (`kv_scales.resolve_kv_scales`).
        self.kv_scales: tuple[float, float] = (1.0, 1.0)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, Hq * D], k and v [T, Hk * D] of the new tokens; returns [T, Hq * D]."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
