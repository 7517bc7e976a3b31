"""The sgl-kernel C++ decode ops for CPU tensors (`sgl-kernel/csrc/decode_cpu.cpp`): the conv update,
the Gated DeltaNet and Mamba2 state updates in place on the pool, and paged decode attention, one call
per layer each instead of ~30 small torch ops and whole-state gather/scatter copies.

`SGLANG_CPU_DECODE_BACKEND`: auto (the C++ ops where sgl-kernel's CPU extension is built, else the torch
steps), torch (force the torch steps, for debugging) or cpp (the C++ ops, or a startup error).
"""

from __future__ import annotations

from typing import Any

import torch

from sglang.srt.environ import envs

CHOICES = ("auto", "torch", "cpp")


def cpu_decode_ops(device: torch.device | str) -> Any | None:
    """`torch.ops.sgl_kernel` when the C++ decode ops serve tensors on `device`, else None."""
    choice = envs.SGLANG_CPU_DECODE_BACKEND.get()
    if choice not in CHOICES:
        raise ValueError(f"SGLANG_CPU_DECODE_BACKEND must be one of {', '.join(CHOICES)}; got {choice!r}.")
    if torch.device(device).type != "cpu" or choice == "torch":
        return None
    from sglang.srt.utils.sgl_kernel import load_extension

    module, reason = load_extension("cpu")
    if module is None:
        if choice == "cpp":
            raise ValueError(f"SGLANG_CPU_DECODE_BACKEND=cpp cannot run: {reason}.")
        return None
    return torch.ops.sgl_kernel
