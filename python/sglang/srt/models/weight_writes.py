"""Which weight storages an in-place weight update wrote, and when: the PD weights fingerprint
(`disaggregation/weights_fingerprint.py`) recomputes after /update_weights_from_tensor and
/update_weights_from_distributed only the tensors written since it last read them. Every in-place write
of a serving model's weights notes its targets here before it copies (`WeightLoader._finish_update`,
load_format "direct" in `ModelRunner.update_weights_from_tensor`), so a write that fails halfway counts as
written too. A storage is named by its address: one freed and reallocated is a new tensor to the
fingerprint's cache anyway (it compares each tensor's address, shape and strides)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import torch

_numbers = itertools.count(1)
_last = 0  # the number of the last write noted
_written: dict[int, int] = {}  # storage address -> the number of the last write noted into it


def note_written(targets: Iterable[torch.Tensor]) -> None:
    """Record that `targets` (parameters or views of them) are about to be written."""
    global _last
    number = next(_numbers)
    for t in targets:
        _written[t.untyped_storage().data_ptr()] = number
    _last = number


def last_write() -> int:
    """The number of the last write noted (0: none)."""
    return _last


def last_write_into(t: torch.Tensor) -> int:
    """The number of the last write noted into `t`'s storage (0: none)."""
    return _written.get(t.untyped_storage().data_ptr(), 0)
