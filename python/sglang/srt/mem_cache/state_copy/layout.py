"""The byte layout of a pool's state tensors, as every state-copy implementation sees it.

A state tensor is `[num_layers, num_slots, *row]` with each row contiguous (any dtype; the layer and
slot strides are free), so row `(layer, slot)` of tensor k starts at
`addr[k] + layer * layer_stride[k] + slot * slot_stride[k]` and is `row_bytes[k]` long.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateLayout:
    addr: tuple[int, ...]
    num_layers: tuple[int, ...]
    layer_stride: tuple[int, ...]  # bytes
    slot_stride: tuple[int, ...]  # bytes
    row_bytes: tuple[int, ...]
    num_slots: int

    @property
    def slot_bytes(self) -> int:
        """Bytes one slot holds over every tensor and layer."""
        return sum(n * r for n, r in zip(self.num_layers, self.row_bytes, strict=True))

    def alignment(self, cap: int = 16) -> int:
        """The largest power of two <= cap dividing every address, stride and row length (and the
        distances between the tensors), i.e. the widest word a kernel may move."""
        g = cap
        for v in (*self.addr, *self.layer_stride, *self.slot_stride, *self.row_bytes):
            g = math.gcd(g, v)
        return g


def describe(tensors: Sequence[torch.Tensor]) -> StateLayout:
    if not tensors:
        raise ValueError("A state copier needs at least one state tensor.")
    device, num_slots = tensors[0].device, tensors[0].shape[1] if tensors[0].dim() >= 2 else -1
    cols: dict[str, list[int]] = {
        k: [] for k in ("addr", "num_layers", "layer_stride", "slot_stride", "row_bytes")
    }
    for t in tensors:
        if t.dim() < 2 or t.device != device or t.shape[1] != num_slots:
            raise ValueError(
                "State tensors must be [num_layers, num_slots, *row] on one device with the same slot count; "
                f"got {tuple(t.shape)} on {t.device} next to {num_slots} slots on {device}."
            )
        if not t[0, 0].is_contiguous():
            raise ValueError(f"Each slot row of a state tensor must be contiguous; strides {t.stride()}.")
        size = t.element_size()
        cols["addr"].append(t.data_ptr())
        cols["num_layers"].append(t.shape[0])
        cols["layer_stride"].append(t.stride(0) * size)
        cols["slot_stride"].append(t.stride(1) * size)
        cols["row_bytes"].append(math.prod(t.shape[2:]) * size)
    return StateLayout(**{k: tuple(v) for k, v in cols.items()}, num_slots=num_slots)
