"""Linears of one input run as one GEMM: their weights become row blocks of one stack (each module's
`weight` a view of its rows: same shape and values, so loads, weight updates and memory release reach
the stack), and the caller slices the stacked product. At decode sizes each GEMM is a launch of a few
microseconds whatever its width, so two projections of the same input in one launch save one per layer
(`benchmark/gpu/kernel_census.py` counts them). Users: Qwen3-Next's GDN input projections and every
attention's q / k / v (`models/qwen3_next.py`, `models/nemotron_h.py`, `layers/llama_attention.py`), a
MoE router with its shared expert's gate (`layers/moe/shared_routing.py`).

Block-FP8 linears (`Fp8BlockLinear`: CUDA's layout of an FP8 checkpoint) stack too (`Fp8Stack`): their FP8
rows and their block scales, each member's rows starting on a scale block (a member whose rows end inside
a block is followed by zero rows to the block's end: no block of the stack mixes two members' scales, so
each member keeps its checkpoint bytes and scales as they are). One activation quantization and one block
GEMM then serve the members, where each took both (2 launches per linear: the census of a decode step of
tiny-qwen3-next in FP8 counts them).

`SGLANG_STACK_LINEARS=0` leaves every linear its own GEMM (to time the difference). The products are the
same dot products, though not always the same bits: a GEMM of another width may split or order K
otherwise (cuBLAS picks its kernel by shape; on CPU a float32 GEMM differed in the last bit), so a router
near a tie may pick another expert with the switch flipped, as with any other kernel choice. A stack applies
only to plain linears (nn.Linear's own forward on a 16-bit or float32 weight, or Fp8BlockLinear's on one
block size; no bias, one dtype and device, no all-reduce: a LoRA-wrapped module keeps its own forward), and
a caller takes it only while nothing hooks the modules (`hooked`: an adapter's hook would be passed by).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.environ import envs
from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, Fp8BlockLinear, block_fp8_linear, fp8_block_kernel

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


def _plain_fp8(lin: nn.Module, block: tuple[int, int]) -> bool:
    """Fp8BlockLinear's forward on blocks of `block`, no bias, no all-reduce."""
    return (
        type(lin) is Fp8BlockLinear
        and "forward" not in lin.__dict__
        and lin.bias is None
        and not lin.reduce_results
        and lin.block == block
    )


class Fp8Stack(NamedTuple):
    """Block-FP8 linears' rows as one: `weight` float8_e4m3fn [rows, in] and `scale_inv` [ceil(rows /
    b0), ceil(in / b1)], member i's rows from `starts[i]` (a multiple of b0)."""

    weight: torch.Tensor
    scale_inv: torch.Tensor
    block: tuple[int, int]
    starts: tuple[int, ...]
    kernel: Any  # `fp8_block_kernel`'s for the stack's device (None: the torch path)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return block_fp8_linear(x, self.weight, self.scale_inv, self.block, self.kernel)


def _stack_fp8(linears: list[Fp8BlockLinear]) -> Fp8Stack:
    """The linears' FP8 rows and scales stacked, each member's rows from a block row (zero rows, scale 1,
    after a member that ends inside a block), each member's weight and scales now views of the stack."""
    first = linears[0]
    b0, device = first.block[0], first.weight.device
    starts, rows = [], 0
    for lin in linears:
        starts.append(-(-rows // b0) * b0)
        rows = starts[-1] + lin.weight.shape[0]
    rows = -(-rows // ROW_ALIGN) * ROW_ALIGN  # (the product's rows aligned as a 16-bit stack's; same blocks)
    weight = torch.zeros(rows, first.weight.shape[1], dtype=FP8_DTYPE, device=device)
    scale = torch.ones(-(-rows // b0), first.weight_scale_inv.shape[1], dtype=torch.float32, device=device)
    for lin, start in zip(linears, starts, strict=True):
        n, blocks = lin.weight.shape[0], lin.weight_scale_inv.shape[0]
        weight[start : start + n] = lin.weight.data
        scale[start // b0 : start // b0 + blocks] = lin.weight_scale_inv.data
        lin.weight.data = weight[start : start + n]
        lin.weight_scale_inv.data = scale[start // b0 : start // b0 + blocks]
    return Fp8Stack(weight, scale, first.block, tuple(starts), fp8_block_kernel(device))


def stack_linear_weights(linears: list[nn.Linear]) -> torch.Tensor | Fp8Stack | None:
    """One [rows, in] stack holding the linears' weights one after another (rows padded with zeros to a
    multiple of ROW_ALIGN at the end), each linear's weight now a view of its rows; for block-FP8 linears
    an `Fp8Stack`. None (nothing changed) unless all are plain, of one dtype (one block size), device and
    input width, and SGLANG_STACK_LINEARS is on."""
    first = linears[0].weight
    same = all(lin.weight.device == first.device and lin.weight.shape[1] == first.shape[1] for lin in linears)
    if not envs.SGLANG_STACK_LINEARS.get() or not same:
        return None
    if all(_plain_fp8(lin, getattr(linears[0], "block", None)) for lin in linears):
        return _stack_fp8(linears)
    if not all(_plain(lin, first.dtype) for lin in linears):
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


def stacked_outputs(
    x: torch.Tensor, linears: tuple[nn.Linear, ...], stack: torch.Tensor | Fp8Stack | None
) -> tuple:
    """Each linear's output for x: column slices of one GEMM on `stack` (theirs, from
    `stack_linear_weights`) where it serves (nothing hooks them), else each linear's own call."""
    if stack is None or hooked(*linears):
        return tuple(lin(x) for lin in linears)
    if isinstance(stack, Fp8Stack):
        y, starts = stack(x), stack.starts
    else:
        y, starts = F.linear(x, stack), _cumulative([lin.weight.shape[0] for lin in linears])
    return tuple(y[:, start : start + lin.weight.shape[0]] for lin, start in zip(linears, starts, strict=True))


def _cumulative(sizes: list[int]) -> list[int]:
    starts, total = [], 0
    for n in sizes:
        starts.append(total)
        total += n
    return starts
