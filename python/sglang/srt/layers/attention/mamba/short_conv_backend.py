"""Short-conv backend (LFM2's `Lfm2ShortConv`): the layer's state is its conv window alone, the last K-1
inputs of a depthwise causal conv without an activation. The layer passes the conv input `Bx` [T, C] and
gets the conv [T, C] float32 back (it multiplies by C itself).

It shares the Mamba2/GDN backends' metadata, state I/O and snapshots (`MambaAttnBackendBase`): an
extend's snapshots are slices of the conv window, a decode step's track copies run as theirs. Every
position has a state, so any kernel state chunk serves; the adapter names 64, as GDN's. The C++ and
Triton convs fuse Mamba2's SiLU, so the torch conv runs on every device (gather, conv, scatter: a GPU
kernel of its own is future work). The pool's SSM part is a small row per layer nothing reads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.layers.attention.mamba.mamba_backend_base import MambaAttnBackendBase
from sglang.srt.mem_cache.memory_pool import MambaPool

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


class ShortConvAttnBackend(MambaAttnBackendBase):
    def __init__(self, mamba_pool: MambaPool, kernel_state_chunk: int):
        super().__init__(mamba_pool, kernel_state_chunk, decode_choice=None, conv_silu=False)

    def forward(self, layer: Any, fb: ForwardBatch, bx: torch.Tensor) -> torch.Tensor:
        weight = layer.conv.weight.view(layer.conv.weight.shape[0], -1)
        if fb.forward_mode.is_decode():
            return self.conv_decode(layer.layer_id, bx, weight, layer.conv.bias)
        return self.conv_extend_packed(layer.layer_id, bx, weight, layer.conv.bias)
