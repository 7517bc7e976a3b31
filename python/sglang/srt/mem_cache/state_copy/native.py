"""The sgl-kernel state-copy ops (C++ for CPU tensors, CUDA for GPU tensors) on one set of state tensors;
building and loading the extensions is `sglang.srt.utils.sgl_kernel`'s job."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType

import torch

from sglang.srt.mem_cache.state_copy.layout import describe


class NativeStateCopy:
    """The C++ (CPU) or CUDA op of sgl-kernel on one set of state tensors; the table is built once."""

    def __init__(self, name: str, module: ModuleType, tensors: Sequence[torch.Tensor]):
        self.name = name
        self._module = module
        lay = describe(tensors)
        self._table = module.StateTable(
            list(lay.addr),
            list(lay.num_layers),
            list(lay.layer_stride),
            list(lay.slot_stride),
            list(lay.row_bytes),
            lay.num_slots,
        )

    def copy(self, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor | None) -> None:
        self._module.copy(self._table, src, dst, mask)

    def clear(self, slots: torch.Tensor) -> None:
        self._module.clear(self._table, slots)
