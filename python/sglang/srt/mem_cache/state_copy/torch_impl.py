"""The torch reference of the state-copy ops (and the fallback where no kernel is built): batched
indexing, one operation per state tensor over all layers. Rows are filtered with a boolean mask,
which on a GPU costs a device sync: acceptable for a reference, one reason the kernels exist."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class TorchStateCopy:
    name = "torch"

    def __init__(self, tensors: Sequence[torch.Tensor]):
        self.tensors = list(tensors)

    def copy(self, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor | None) -> None:
        keep = (dst > 0) & (src >= 0) & (src != dst)
        if mask is not None:
            keep &= mask
        s, d = src[keep], dst[keep]
        for t in self.tensors:
            t[:, d] = t[:, s]

    def clear(self, slots: torch.Tensor) -> None:
        idx = slots[slots > 0]
        for t in self.tensors:
            t.index_fill_(1, idx, 0)
