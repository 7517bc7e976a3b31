"""Llama-style full attention: q/k/v projections, optional per-head q/k RMSNorms, rotary positions (or
none), GQA and `o_proj`, at a given scale. Granite-4.0-H's (its `attention_multiplier`, rotary or
`nope`), Falcon-H1's, Bamba's and LFM2's (q/k norms). Tensor parallel: `set_attention_projections`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from sglang.srt.configs.hybrid_arch import parallel_attention_heads
from sglang.srt.distributed import get_tensor_model_parallel_world_size
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import ColumnParallelLinear, RowParallelLinear
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.layers.stacked_linears import stack_linear_weights, stacked_outputs
from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class LlamaStyleAttention(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_id: int,
        *,
        scale: float | None = None,
        rope_parameters: dict[str, Any] | None,
        bias: bool = False,
        qk_norm_eps: float | None = None,
        reduce_results: bool = True,
    ):
        """`scale` None: 1/sqrt(head_dim). `rope_parameters` None: no positions. `qk_norm_eps`: RMSNorm
        each head of q and k (before the rotation) with this eps; None: no q/k norms. `reduce_results` False:
        the output is this rank's part of the sum (the caller reduces)."""
        super().__init__()
        self.head_dim = head_dim
        self.num_heads, self.num_kv_heads = set_attention_projections(
            self, hidden_size, num_heads, num_kv_heads, head_dim, bias, reduce_results
        )
        self.q_norm = RMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, eps=qk_norm_eps) if qk_norm_eps is not None else None
        self.rotary_emb = get_rope(head_dim, rope_parameters) if rope_parameters is not None else None
        scale = head_dim**-0.5 if scale is None else scale
        self.attn = RadixAttention(self.num_heads, head_dim, scale, self.num_kv_heads, layer_id)
        self.qkv_stack: torch.Tensor | None = None  # q / k / v as one GEMM (set at load: stacked_linears.py)

    def process_weights_after_loading(self) -> None:
        if self.qkv_stack is None:
            self.qkv_stack = stack_linear_weights([self.q_proj, self.k_proj, self.v_proj])

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        t = hidden.shape[0]
        q, k, v = stacked_outputs(hidden, (self.q_proj, self.k_proj, self.v_proj), self.qkv_stack)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if self.rotary_emb is not None and self.q_norm is not None:  # (one launch on CUDA)
            q, k = self.rotary_emb.forward_with_norms(positions, q, k, self.q_norm, self.k_norm, fb.rope_cache)
        else:
            if self.q_norm is not None:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotary_emb is not None:
                q, k = self.rotary_emb(positions, q, k, fb.rope_cache)
        return self.o_proj(self.attn(q.reshape(t, -1), k.reshape(t, -1), v, fb))


def set_attention_projections(
    module: nn.Module,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    bias: bool,
    reduce_results: bool = True,
) -> tuple[int, int]:
    """Give `module` its `q_proj`, `k_proj`, `v_proj` and `o_proj` for this TP rank: the query heads split,
    the key/value heads split or, where the TP size exceeds their count, each held by tp / num_kv_heads
    ranks (those whose query heads read it); `o_proj` row-parallel. Returns the rank's (query heads,
    key/value heads)."""
    heads, kv_heads = parallel_attention_heads(num_heads, num_kv_heads)
    tp = get_tensor_model_parallel_world_size()
    kv_parts = min(num_kv_heads, tp)
    module.q_proj = ColumnParallelLinear(hidden_size, num_heads * head_dim, bias, what="the attention heads")
    for name in ("k_proj", "v_proj"):
        proj = ColumnParallelLinear(
            hidden_size, num_kv_heads * head_dim, bias, parts=kv_parts, what="the key/value heads"
        )
        setattr(module, name, proj)
    module.o_proj = RowParallelLinear(
        num_heads * head_dim, hidden_size, bias, reduce_results=reduce_results, what="the attention heads"
    )
    return heads, kv_heads
