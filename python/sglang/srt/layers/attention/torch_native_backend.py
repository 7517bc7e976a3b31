"""Paged full attention in plain torch, over `req_to_token` and `MHATokenToKVPool`.

The new tokens' K/V are stored at `out_cache_loc` first; then every query attends to the KV slots
`req_to_token[row, :seq_len]` of its request, causally (query at position p sees keys 0..p). Any page
size works, since only slot ids are read. Both modes run torch's fused `scaled_dot_product_attention`
(its flash kernel on CPU accumulates in float32); grouped-query heads share their KV head without copying
it (`enable_gqa`). A float32 decode of large GQA groups runs two matmuls per KV head instead
(`GROUPED_DECODE_MIN_WORK`; `benchmark/bench_decode_attention_cpu.py`). Where sgl-kernel's CPU extension is
built, a decode runs its C++ op instead, which reads each request's keys and values in place through
`req_to_token` (no gathered copy; `SGLANG_CPU_ATTN_BACKEND=torch` forces the SDPA path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from sglang.srt.layers.cpu_ops import cpu_attention_ops
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool, byte_rows

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


# A float32 decode whose (query heads per KV head) x (head dim) reaches this runs two matmuls over each
# KV head's whole group instead of SDPA, whose CPU flash kernel re-reads the keys for every query head.
# `benchmark/bench_decode_attention_cpu.py`, one thread, SDPA time / matmuls time: group x dim 256
# (4 x 64) 0.87-0.90; 512 (8 x 64) 1.18-1.24; 512 (4 x 128) 1.41; 1,024 (4 x 256) 1.56; 2,048
# (8 x 256, Qwen3-Next-80B) 1.6-2.5; the tiny presets (2 x 16) ~1.0.
GROUPED_DECODE_MIN_WORK = 512
# An extend over a cached prefix of at least this many new tokens runs as two flash calls (prefix, then the
# new tokens causally) merged by log-sum-exp on CPU: 16 x (256 over 1,300), 64 over 1,984 and 512 over 512
# tokens measured 1.3-1.4x faster than one masked call; 8 new tokens 2.5x slower (two calls' overhead).
SPLIT_PREFIX_MIN_TOKENS = 16
# torch's CPU flash kernel with its log-sum-exp. It shares KV heads between query heads (GQA) from torch 2.9
# on (pytorch#157893); before that SDPA's front end expanded them, so older torch keeps the masked call.
_CPU_FLASH = (
    getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if torch.torch_version.TorchVersion(torch.__version__) >= (2, 9)
    else None
)


class TorchNativeAttnBackend:
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: MHATokenToKVPool):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = token_to_kv_pool
        self.meta = _Metadata()
        self.cpu_ops = cpu_attention_ops(self.req_to_token.device)

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
        elif fb.forward_mode.is_decode() and fb.batch_size and self.cpu_ops is None:
            max_len = max(fb.seq_lens_cpu)
            rows = fb.req_pool_indices
            kv = self.req_to_token[rows, :max_len].long()
            mask = torch.arange(max_len, device=kv.device)[None, :] < fb.seq_lens[:, None]
            self.meta = _Metadata(decode_kv_indices=kv, decode_mask=mask)
        else:
            self.release_metadata()

    def release_metadata(self) -> None:
        """Drop the last batch's metadata (its tensors)."""
        self.meta = _Metadata()

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        hq, hk, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        num_tokens = q.shape[0]
        q = q.view(num_tokens, hq, d)
        k_scale, v_scale = layer.kv_scales
        self.kv_pool.set_kv_buffer(
            layer.layer_id, fb.out_cache_loc, k.view(-1, hk, d), v.view(-1, hk, d), k_scale, v_scale
        )
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer.layer_id)
        # Scaled float8 K and V are read as stored x scale: k_scale folds into the softmax scale, v_scale
        # into the output (both exact: scores and outputs are linear in K and V).
        scaling = layer.scaling * k_scale
        out_dtype, q = q.dtype, q.to(_compute_dtype(q.dtype, k_buf.dtype))
        if fb.forward_mode.is_decode() and self.cpu_ops is not None:
            out = self.cpu_ops.decode_attention(
                q.float().contiguous(),
                k_buf,
                v_buf,
                self.req_to_token,
                fb.req_pool_indices,
                fb.seq_lens,
                scaling,
            )
        elif fb.forward_mode.is_decode():
            out = self._decode(q, k_buf, v_buf, scaling)
        else:
            out = torch.empty_like(q, dtype=out_dtype)
            for seq in self.meta.extend:
                qs = slice(seq.q_start, seq.q_start + seq.q_len)
                kv = seq.kv_indices
                out[qs] = self._extend_one(
                    q[qs], _gather(k_buf, kv, q.dtype), _gather(v_buf, kv, q.dtype), seq, scaling
                )
        if v_scale != 1.0:
            out = out * v_scale
        return out.to(out_dtype).view(num_tokens, hq * d)

    @staticmethod
    def _extend_one(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq: _ExtendSeq, scaling: float
    ) -> torch.Tensor:
        """q [E, Hq, D] against k, v [S, Hk, D] of the whole sequence (prefix + extend), through torch's
        fused SDPA (the flash kernel on CPU: no float [E, S] score matrix). Without a prefix the mask is
        plain causal. With one, query i sees keys 0..prefix_len + i (SDPA's `is_causal` aligns the
        diagonal top-left): on CPU the prefix (no mask) and the new keys (causal) are two flash calls
        merged by their log-sum-exps, 1.3-1.4x faster than one call with a boolean [E, S] mask, which SDPA
        turns into a float one (`SPLIT_PREFIX_MIN_TOKENS`); else that masked call."""
        e, p = q.shape[0], seq.prefix_len
        # 4-D inputs: with 3-D ones torch takes the unfused math path.
        q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
        if p and e >= SPLIT_PREFIX_MIN_TOKENS and q.device.type == "cpu" and _CPU_FLASH is not None:
            out_p, lse_p = _CPU_FLASH(q4, k4[:, :, :p], v4[:, :, :p], 0.0, False, scale=scaling)
            out_n, lse_n = _CPU_FLASH(q4, k4[:, :, p:], v4[:, :, p:], 0.0, True, scale=scaling)
            top = torch.maximum(lse_p, lse_n)
            w_p, w_n = (lse_p - top).exp_().unsqueeze(-1), (lse_n - top).exp_().unsqueeze(-1)
            return ((out_p * w_p + out_n * w_n) / (w_p + w_n)).to(q.dtype)[0].transpose(0, 1)
        mask = None
        if p:
            mask = torch.ones(e, k.shape[0], dtype=torch.bool, device=q.device).tril(p)
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, is_causal=mask is None, scale=scaling, enable_gqa=True
        )
        return out[0].transpose(0, 1)

    def _decode(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, scaling: float) -> torch.Tensor:
        """q [bs, Hq, D]; every request attends to its own slot row, gathered padded to the longest
        (`index_select` gathers ~3x faster than advanced indexing on CPU) and masked past its length,
        in one fused SDPA call for the batch (large float32 GQA groups: `GROUPED_DECODE_MIN_WORK`)."""
        bs, hq, d = q.shape
        kv, mask = self.meta.decode_kv_indices, self.meta.decode_mask
        length, hk = kv.shape[1], k_buf.shape[1]
        flat = kv.reshape(-1)
        k = _gather(k_buf, flat, q.dtype).view(bs, length, hk, d).transpose(1, 2)
        v = _gather(v_buf, flat, q.dtype).view(bs, length, hk, d).transpose(1, 2)
        group = hq // hk
        if group * d >= GROUPED_DECODE_MIN_WORK and q.dtype == torch.float32:
            scores = torch.matmul(q.view(bs, hk, group, d), k.transpose(-1, -2)) * scaling
            probs = scores.masked_fill(~mask[:, None, None, :], float("-inf")).softmax(-1)
            return torch.matmul(probs, v).view(bs, hq, d)
        out = F.scaled_dot_product_attention(
            q[:, :, None],
            k,
            v,
            attn_mask=mask[:, None, None, :],
            scale=scaling,
            enable_gqa=True,
        )
        return out[:, :, 0]


def _compute_dtype(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> torch.dtype:
    """What the torch path attends in: the query's dtype, unless the pool holds values that dtype cannot.
    A bfloat16 pool under a float16 model does: a key or value near float16's largest (65504) rounds to
    65536 in bfloat16, which is inf in float16 (one such key makes the request's output NaN); float32
    holds every bfloat16 value (the C++ op and the Triton kernels attend in float32 anyway)."""
    if q_dtype == torch.float16 and kv_dtype == torch.bfloat16:
        return torch.float32
    return q_dtype


def _gather(buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows `slots` of a KV pool layer in the compute dtype (a `--kv-cache-dtype` pool converts after the
    gather, so only the rows read are converted)."""
    rows = byte_rows(buf).index_select(0, slots).view(buf.dtype)  # (float8 gathered as bytes)
    return rows if rows.dtype == dtype else rows.to(dtype)
