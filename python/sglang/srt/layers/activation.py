"""Activations by their HF config names."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "relu2": relu2,
    "relu": F.relu,
    "gelu": F.gelu,
}


def get_act_fn(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    try:
        return _ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"Activation {name!r} is not supported; known: {sorted(_ACTIVATIONS)}.") from None
