"""Which layers take their Triton kernel on a GPU: one rule for every `SGLANG_GPU_*_BACKEND` variable and
the linear layers' decode choice. Nothing here imports triton up front: the kernel modules are imported
when a layer is set up to run them, so a CPU install without triton serves as before."""

from __future__ import annotations

import importlib
import logging
from typing import Any

import torch

logger = logging.getLogger(__name__)
_warned: set[str] = set()


def triton_chosen(
    choice: Any, device: torch.device, *kernel_modules: str, also_triton: tuple[str, ...] = ()
) -> bool:
    """Whether `choice` (an environment variable: auto, torch or triton, or one of the variable's own
    `also_triton` values, which count as triton) puts a layer on its Triton kernel for weights on
    `device`: auto on CUDA where the `kernel_modules` import, triton anywhere (on CPU tensors only under
    TRITON_INTERPRET=1, for tests; an import failure then raises). A bad value is one sentence naming the
    variable; an auto choice that cannot import warns once and takes torch."""
    value = choice.get()
    if value in also_triton:
        value = "triton"
    elif value not in ("auto", "torch", "triton"):
        allowed = ", ".join(("auto", "torch", "triton", *also_triton))
        raise ValueError(f"{choice.name} must be one of {allowed}; got {value!r}.")
    if not (value == "triton" or (value == "auto" and device.type == "cuda")):
        return False
    try:
        for name in kernel_modules:
            importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - no usable triton: the torch form serves
        if value == "triton":
            raise
        if choice.name not in _warned:
            _warned.add(choice.name)
            logger.warning("%s: the Triton kernels are unavailable (%s); using the torch form.", choice.name, e)
        return False
    return True
