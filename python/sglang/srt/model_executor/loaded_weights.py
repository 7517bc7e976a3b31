"""`LoadedWeights`: what /update_weights_from_disk loads beside the serving model and swaps in
(`ModelRunner.load_like_current`, `swap_model`), and the check that it is the same network in shape."""

from __future__ import annotations

from typing import NamedTuple

from torch import nn


class LoadedWeights(NamedTuple):
    """What /update_weights_from_disk loads (`load_like_current`) and `swap_model` serves: the model and,
    with EAGLE / NEXTN, its MTP layer (else None)."""

    model: nn.Module
    draft_model: nn.Module | None


def check_same_parameters(new: nn.Module, old: nn.Module, prefix: str = "") -> None:
    """ValueError, in one sentence, where `new`'s parameters differ from `old`'s in name, shape or dtype."""
    shapes = {name: (tuple(p.shape), p.dtype) for name, p in new.named_parameters()}
    for name, param in old.named_parameters():
        if shapes.pop(name, None) != (tuple(param.shape), param.dtype):
            raise ValueError(
                f"its parameter {prefix}{name} differs from the serving model's in shape or dtype"
            )
    if shapes:
        raise ValueError(f"it has a parameter the serving model lacks: {prefix}{next(iter(shapes))}")
