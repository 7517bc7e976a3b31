"""`HybridLinearAttnBackend`: one backend object per model, dispatching each layer to the full-attention
backend (KV pool) or the linear-attention backend (mamba pool), as upstream SGLang does.

`init_forward_metadata` runs once per batch on the forward stream, before the first layer: for an
extend it first executes the deferred state operations the scheduler recorded (clear fresh slots, then
copy checkpoints into running slots), so no layer reads a slot before they are done; then it builds both
backends' per-batch index tensors. `finish_forward` runs after the last layer: a decode's track copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.attention.mamba.mamba_backend_base import MambaAttnBackendBase
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.mem_cache.memory_pool import MambaPool

if TYPE_CHECKING:
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class HybridLinearAttnBackend:
    def __init__(
        self,
        full_attn_backend: TorchNativeAttnBackend,
        linear_attn_backend: MambaAttnBackendBase,
        full_attn_layers: Sequence[int],
    ):
        self.full_attn_backend = full_attn_backend
        self.linear_attn_backend = linear_attn_backend
        self.full_attn_layers = frozenset(full_attn_layers)

    @property
    def mamba_pool(self) -> MambaPool:
        return self.linear_attn_backend.mamba_pool

    def prepare_host_metadata(self, fb: ForwardBatch) -> None:
        """Before the batch moves to the device: index tensors built on the host go with it
        (`ForwardBatch.aux_tensors`)."""
        self.linear_attn_backend.prepare_host_metadata(fb)

    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_extend():
            self._execute_deferred_mamba_cow_and_clear(fb)
        self.full_attn_backend.init_forward_metadata(fb)
        self.linear_attn_backend.init_forward_metadata(fb)

    def release_metadata(self) -> None:
        """Drop what the last batch left in both backends (`CudaGraphRunner.release`: the last capture's
        tensors, in the graphs' memory pool)."""
        self.full_attn_backend.release_metadata()
        self.linear_attn_backend.release_metadata()

    def finish_forward(self, fb: ForwardBatch) -> None:
        """After the last layer, before sampling: a decode's track copies (all layers in one launch)."""
        if fb.forward_mode.is_decode():
            self.linear_attn_backend.track_decode_states()

    def _execute_deferred_mamba_cow_and_clear(self, fb: ForwardBatch) -> None:
        """Clear first, then copy: a slot that is both cleared and a copy destination ends up holding
        the copy."""
        if fb.mamba_clear_indices is not None and not envs.SGLANG_TEST_SKIP_DEFERRED_CLEAR.get():
            self.mamba_pool.clear_slots(fb.mamba_clear_indices)
        if fb.mamba_cow_src_indices is not None and not envs.SGLANG_TEST_SKIP_DEFERRED_COW.get():
            assert fb.mamba_cow_dst_indices is not None, "mamba_cow_src_indices without destinations"
            self.mamba_pool.copy_from(fb.mamba_cow_src_indices, fb.mamba_cow_dst_indices)
        fb.mamba_clear_indices = fb.mamba_cow_src_indices = fb.mamba_cow_dst_indices = None

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, fb: ForwardBatch
    ) -> torch.Tensor:
        assert layer.layer_id in self.full_attn_layers, f"layer {layer.layer_id} is not full attention"
        return self.full_attn_backend.forward(q, k, v, layer, fb)

    def forward_linear(self, layer: Any, fb: ForwardBatch, *inputs: torch.Tensor) -> torch.Tensor:
        """A linear-attention layer's state-touching part (see the GDN / Mamba2 backends for inputs)."""
        assert layer.layer_id not in self.full_attn_layers, f"layer {layer.layer_id} is full attention"
        if fb.forward_mode.is_target_verify():
            return self.linear_attn_backend.forward_verify(layer, fb, *inputs)
        return self.linear_attn_backend.forward(layer, fb, *inputs)
