"""Which layers take their Triton kernel on a GPU: one rule for every `SGLANG_GPU_*_BACKEND` variable.
Nothing here imports triton: the kernel modules are imported where a layer runs them, so a CPU install
without triton serves as before."""

from __future__ import annotations

from typing import Any

import torch


def triton_chosen(choice: Any, device: torch.device) -> bool:
    """Whether a `SGLANG_GPU_*_BACKEND` variable (`choice`: auto, torch or triton) puts a layer on its
    Triton kernel for weights on `device`: auto on CUDA, triton anywhere (on CPU tensors only under
    TRITON_INTERPRET=1, for tests). A bad value is one sentence naming the variable."""
    value = choice.get()
    if value not in ("auto", "torch", "triton"):
        raise ValueError(f"{choice.name} must be auto, torch or triton; got {value!r}.")
    return value == "triton" or (value == "auto" and device.type == "cuda")
