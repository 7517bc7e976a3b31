"""Linears of one input run as one GEMM: their weights become row blocks of one stack (each module's
`weight` a view of its rows: same shape and values, so loads, weight updates and memory release reach
the stack), and the caller slices the stacked product. At decode sizes each GEMM is a launch of a few
microseconds whatever its width, so two projections of the same input in one launch save one per layer
(`benchmark/gpu/kernel_census.py` counts them). Users: Qwen3-Next's GDN input projections and every
attention's q / k / v (`models/qwen3_next.py`, `models/nemotron_h.py`, `layers/llama_attention.py`), a
MoE router with its shared expert's gate (`layers/moe/shared_routing.py`).

`SGLANG_STACK_LINEARS=0` leaves every linear its own GEMM (to time the difference). The products are the
same dot products, though not always the same bits: a GEMM of another width may split or order K
otherwise (cuBLAS picks its kernel by shape; on CPU a float32 GEMM differed in the last bit), so a router
near a tie may pick another expert with the switch flipped, as with any other kernel choice. A stack applies
only to plain linears (nn.Linear's own forward on a 16-bit or float32 weight, no bias,
one dtype and device: an FP8 or LoRA-wrapped module keeps its own forward), and a caller takes it only
while nothing hooks the modules (`hooked`: an adapter's hook would be passed by).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.environ import envs

ROW_ALIGN = 8  # the stack's rows padded to a multiple of this (16-bit rows of the product: 16 bytes)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _plain(lin: nn.Module, dtype: torch.dtype) -> bool:
    """nn.Linear's forward on its weight of `dtype` (one of DTYPES), no bias."""
    return (
        isinstance(lin, nn.Linear)
        and type(lin).forward is nn.Linear.forward
        and "forward" not in lin.__dict__
        and lin.bias is None
        and lin.weight.dtype == dtype in DTYPES
    )


def stack_linear_weights(linears: list[nn.Linear]) -> torch.Tensor | None:
    """One [rows, in] stack holding the linears' weights one after another (rows padded with zeros to a
    multiple of ROW_ALIGN at the end), each linear's weight now a view of its rows; None (nothing
    changed) unless all are plain, of one dtype, device and input width, and SGLANG_STACK_LINEARS is on."""
    first = linears[0].weight
    if not envs.SGLANG_STACK_LINEARS.get() or not all(
        _plain(lin, first.dtype) and lin.weight.device == first.device and lin.weight.shape[1] == first.shape[1]
        for lin in linears
    ):
        return None
    rows = sum(lin.weight.shape[0] for lin in linears)
    stack = torch.zeros(-(-rows // ROW_ALIGN) * ROW_ALIGN, first.shape[1], dtype=first.dtype, device=first.device)
    start = 0
    for lin in linears:
        n = lin.weight.shape[0]
        stack[start : start + n] = lin.weight.data
        lin.weight.data = stack[start : start + n]
        start += n
    return stack


def hooked(*modules: nn.Module) -> bool:
    """Whether a forward (pre-)hook sits on any of `modules` (a LoRA adapter's, for one)."""
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


def stacked_outputs(x: torch.Tensor, linears: tuple[nn.Linear, ...], stack: torch.Tensor | None) -> tuple:
    """Each linear's output for x: column slices of one GEMM on `stack` (theirs, from
    `stack_linear_weights`) where it serves (nothing hooks them), else each linear's own call."""
    if stack is None or hooked(*linears):
        return tuple(lin(x) for lin in linears)
    y = F.linear(x, stack)
    out, start = [], 0
    for lin in linears:
        n = lin.weight.shape[0]
        out.append(y[:, start : start + n])
        start += n
    return tuple(out)
