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
        # The checkpoint's per-layer float8 KV cache scales (upstream's names; None where it has none):
        # a float8 pool stores K / k_scale and V / v_scale (`MHATokenToKVPool.layer_scales`).
        self.k_scale: float | None = None
        self.v_scale: float | None = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """q [T, Hq * D], k and v [T, Hk * D] of the new tokens; returns [T, Hq * D]."""
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch)
