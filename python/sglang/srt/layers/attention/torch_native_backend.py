"""Paged full attention in plain torch, over `req_to_token` and `MHATokenToKVPool`.

The new tokens' K/V are stored at `out_cache_loc` first; then every query attends to the KV slots
`req_to_token[row, :seq_len]` of its request, causally (query at position p sees keys 0..p). Any page
size works, since only slot ids are read. Scores and softmax are computed in float32; grouped-query
heads share their KV head without copying it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class _ExtendSeq:
    q_start: int
    q_len: int
    prefix_len: int
    kv_indices: torch.Tensor  # [seq_len] int64


@dataclass
class _Metadata:
    extend: list[_ExtendSeq] | None = None
    decode_kv_indices: torch.Tensor | None = None  # [bs, max_len]
    decode_mask: torch.Tensor | None = None  # [bs, max_len] True where the key exists


class TorchNativeAttnBackend:
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MHATokenToKVPool):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = token_to_kv_pool
        self.meta = _Metadata()

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_extend():
            seqs = []
            for i, row in enumerate(fb.req_pool_indices_cpu):
                seq_len = fb.seq_lens_cpu[i]
                seqs.append(
                    _ExtendSeq(
                        q_start=fb.extend_start_loc_cpu[i],
                        q_len=fb.extend_seq_lens_cpu[i],
                        prefix_len=fb.extend_prefix_lens_cpu[i],
                        kv_indices=self.req_to_token[row, :seq_len].long(),
                    )
                )
            self.meta = _Metadata(extend=seqs)
        elif fb.forward_mode.is_decode() and fb.batch_size:
            max_len = max(fb.seq_lens_cpu)
            rows = fb.req_pool_indices
            kv = self.req_to_token[rows, :max_len].long()
            mask = torch.arange(max_len, device=kv.device)[None, :] < fb.seq_lens[:, None]
            self.meta = _Metadata(decode_kv_indices=kv, decode_mask=mask)
        else:
            self.meta = _Metadata()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        hq, hk, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        num_tokens = q.shape[0]
        q = q.view(num_tokens, hq, d)
        self.kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k.view(-1, hk, d), v.view(-1, hk, d))
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer.layer_id)
        if fb.forward_mode.is_decode():
            out = self._decode(q, k_buf, v_buf, layer)
        else:
            out = torch.empty_like(q)
            for seq in self.meta.extend:
                qs = slice(seq.q_start, seq.q_start + seq.q_len)
                kv = seq.kv_indices
                out[qs] = self._extend_one(
                    q[qs], k_buf.index_select(0, kv), v_buf.index_select(0, kv), seq, layer
                )
        return out.view(num_tokens, hq * d)

    @staticmethod
    def _extend_one(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: _ExtendSeq, layer: RadixAttention
    ) -> torch.Tensor:
        """q [E, Hq, D] against k, v [S, Hk, D] of the whole sequence (prefix + extend)."""
        e, hq, d = q.shape
        s, hk = k.shape[0], k.shape[1]
        group = hq // hk
        qg = q.float().view(e, hk, group, d).permute(1, 2, 0, 3)  # [Hk, g, E, D]
        kf, vf = k.float().permute(1, 0, 2), v.float().permute(1, 0, 2)  # [Hk, S, D]
        scores = torch.matmul(qg, kf[:, None].transpose(-1, -2)) * layer.scaling  # [Hk, g, E, S]
        q_pos = torch.arange(e, device=q.device)[:, None] + seq.prefix_len
        allowed = torch.arange(s, device=q.device)[None, :] <= q_pos
        scores = scores.masked_fill(~allowed, float("-inf"))
        out = torch.matmul(scores.softmax(dim=-1), vf[:, None])  # [Hk, g, E, D]
        return out.permute(2, 0, 1, 3).reshape(e, hq, d).to(q.dtype)

    def _decode(
        self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, layer: RadixAttention
    ) -> torch.Tensor:
        """q [bs, Hq, D]; every request attends to its own (padded, masked) slot row. One batched matmul
        per KV head reads the gathered keys in place (strided), instead of einsum's permuted copies;
        `index_select` gathers ~3x faster than advanced indexing on CPU."""
        bs, hq, d = q.shape
        kv, mask = self.meta.decode_kv_indices, self.meta.decode_mask
        length, hk = kv.shape[1], k_buf.shape[1]
        flat = kv.reshape(-1)
        k = k_buf.index_select(0, flat).view(bs, length, hk, d).float()
        v = v_buf.index_select(0, flat).view(bs, length, hk, d).float()
        qg = q.float().view(bs, hk, hq // hk, d)
        pad = ~mask[:, None, :]
        out = torch.empty(hk, bs, hq // hk, d, dtype=torch.float32, device=q.device)
        for h in range(hk):
            scores = torch.bmm(qg[:, h], k[:, :, h].transpose(1, 2)) * layer.scaling  # [bs, g, L]
            probs = scores.masked_fill_(pad, float("-inf")).softmax(dim=-1)
            torch.bmm(probs, v[:, :, h], out=out[h])  # contiguous: written in place
        return out.permute(1, 0, 2, 3).reshape(bs, hq, d).to(q.dtype)
