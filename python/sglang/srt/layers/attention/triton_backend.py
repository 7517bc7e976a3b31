"""`TritonAttnBackend` (`--attention-backend triton`): paged full attention through the project's own
Triton kernels (`triton_ops/`), the default on CUDA.

The new tokens' K/V are stored at `out_cache_loc` first (as in the torch-native backend); the kernels
then read every key through `req_to_token`, so any page size works and a cached prefix is read in place,
never gathered. Decode is split over the key range (`--triton-attention-num-kv-splits`, upstream's flag
and default) and reads all lengths on the device: nothing per batch is decided on the host, so a decode
is CUDA-graph safe. An extend's per-batch metadata is the new tokens' start offsets (one cumsum on the
device) and the longest extend (a host int, for the grid; a verify of fixed width gives it without a
host list, so its graph is CUDA-graph safe too). On CUDA an extend batch that is not a verify takes
torch's FlashAttention-2 varlen kernel where it applies (`flash_extend.py`), its layout built once per
batch from the host lists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang.srt.layers.attention import flash_extend
from sglang.srt.layers.attention.triton_ops.decode_attention import decode_attention_fwd
from sglang.srt.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

DEFAULT_NUM_KV_SPLITS = 8


class TritonAttnBackend:
    def __init__(
        self,
        req_to_token_pool: ReqToTokenPool,
        token_to_kv_pool: MHATokenToKVPool,
        num_kv_splits: int = DEFAULT_NUM_KV_SPLITS,
    ):
        self.req_to_token = req_to_token_pool.req_to_token
        self.kv_pool = token_to_kv_pool
        self.num_kv_splits = num_kv_splits
        self.extend_start_loc: torch.Tensor | None = None
        self.max_extend_len = 0
        # Extend batches through FlashAttention-2 where it applies (flash_extend.py), decided once.
        self.flash_extend = flash_extend.chosen(self.req_to_token.device)
        self.flash_meta: flash_extend.ExtendMeta | None = None
        # One key's K and V (all heads; every layer's buffer is alike): the flash path's gather bound.
        k0 = token_to_kv_pool.k_buffer[0] if token_to_kv_pool.k_buffer else None
        self.key_bytes = 2 * k0[0].numel() * k0.element_size() if k0 is not None else 0

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_extend():
            lens = fb.extend_seq_lens
            self.extend_start_loc = torch.cumsum(lens, 0) - lens
            # (a graph-shaped verify: its width, with no host list read)
            self.max_extend_len = fb.verify_width or max(fb.extend_seq_lens_cpu, default=0)
            self.flash_meta = None
            if self.flash_extend and not fb.forward_mode.is_target_verify():
                self.flash_meta = flash_extend.build_meta(
                    self.req_to_token, fb.req_pool_indices_cpu, fb.extend_prefix_lens_cpu,
                    fb.extend_seq_lens_cpu, lens, fb.seq_lens, self.key_bytes,
                )  # fmt: skip
        else:
            self.release_metadata()

    def release_metadata(self) -> None:
        """Drop the last batch's metadata (a CUDA graph's capture leaves it in that graph's memory pool)."""
        self.extend_start_loc, self.max_extend_len, self.flash_meta = None, 0, None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        hq, hk, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        num_tokens = q.shape[0]
        k_scale, v_scale = layer.kv_scales
        self.kv_pool.set_kv_buffer(
            layer.layer_id, fb.out_cache_loc, k.view(-1, hk, d), v.view(-1, hk, d), k_scale, v_scale
        )
        k_buf, v_buf = self.kv_pool.get_kv_buffer(layer.layer_id)
        # Scaled float8 K and V: k_scale folds into the softmax scale, v_scale into the output (as the
        # torch-native backend does), so the kernels read the stored values unchanged.
        scaling = layer.scaling * k_scale
        q = q.reshape(num_tokens, hq, d)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if self.flash_meta is not None and flash_extend.applies(q, k_buf, k_scale, v_scale):
            out = flash_extend.extend_attention(
                q, k.view(-1, hk, d), v.view(-1, hk, d), k_buf, v_buf, self.flash_meta, scaling
            )
            return out.view(num_tokens, hq * d)
        out = torch.empty(num_tokens, hq, d, dtype=q.dtype, device=q.device)
        if fb.forward_mode.is_decode():
            decode_attention_fwd(
                q, k_buf, v_buf, out, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                scaling, self.num_kv_splits,
            )  # fmt: skip
        else:
            extend_attention_fwd(
                q, k_buf, v_buf, out, self.req_to_token, fb.req_pool_indices, fb.seq_lens,
                fb.extend_seq_lens, self.extend_start_loc, self.max_extend_len, scaling,
            )  # fmt: skip
        if v_scale != 1.0:
            out.mul_(v_scale)
        return out.view(num_tokens, hq * d)
