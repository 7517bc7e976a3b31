"""A check that runs once per CUDA device (a kernel a torch build or GPU may lack, tried on a small case
at load): its answer cached by device index, never on another device type."""

from __future__ import annotations

from collections.abc import Callable

import torch


def probed_once(cache: dict[int, bool], device: torch.device, probe: Callable[[torch.device], bool]) -> bool:
    """`probe(device)`'s answer, run on the first ask for that CUDA device and kept in `cache`; False for a
    device that is not CUDA."""
    if device.type != "cuda":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in cache:
        cache[index] = probe(torch.device("cuda", index))
    return cache[index]
