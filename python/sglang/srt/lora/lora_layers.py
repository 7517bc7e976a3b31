"""The LoRA delta of one linear module, for every request of a batch at once.

Each target linear keeps its parameters and names (weight updates, fingerprints and the FP8 swap see
the model as before) and gains a forward hook and two buffers: `a` [S * R, in] holds slot s's A in rows
s * R .. s * R + r, and `b` [out, S * R] the matching columns of scaling * B (S slots of at most R =
--max-lora-rank; a slot's unused rows and columns, and a module its adapter leaves alone, are zeros).
The hook adds

    delta = ((x a^T) * mask) b^T,    mask[t, s * R + j] = 1 if token t's request runs slot s's adapter

to the module's output: one pair of matmuls of fixed shapes whatever the batch mixes (a request on the
base model has an all-zero mask row), so a CUDA graph captures it as it is; its cost over the base is
S * R columns (at 8 slots of rank 16, 128 against the thousands of a projection's rows).

Tensor parallelism: the buffers are sharded as the weight is. A column-parallel module's `b` holds this
rank's output rows. A row-parallel one's `a` holds this rank's input columns, so `x a^T` is a partial
sum: it is all-reduced ([T, S * R], small) before the mask; its delta is then whole on every rank and
is added where the module's own output is whole too (after its all-reduce), or on rank 0 alone where
the caller sums the ranks' outputs (`reduce_results=False`, as the module's bias is).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import get_tensor_model_parallel_rank, get_tp_group
from sglang.srt.layers.linear import DimShard, weight_shards


class LoRABatch:
    """The running forward's per-token mask over the slots [lo, hi) that hold its adapters ([tokens,
    hi - lo], the model's dtype), set before the model runs (`LoRAManager._prepare`); None: no request
    of the batch runs an adapter. Outside CUDA graphs [lo, hi) is the batch's (a batch on one adapter
    reads one slot's columns: S times fewer than all); a graph's covers every slot."""

    def __init__(self, slots: int, rank: int):
        self.slots, self.rank = slots, rank
        self.mask: torch.Tensor | None = None
        self.lo, self.hi = 0, slots


class LoRAModule:
    """One target linear's slot buffers and the hook that adds their delta."""

    def __init__(self, name: str, linear: nn.Module, batch: LoRABatch, dtype: torch.dtype, pieces: int = 1):
        """`pieces`: how many checkpoint modules load into this one (Qwen3.5's in_proj_qkv and in_proj_z
        into in_proj_qkvz): a slot then holds that many adapters' modules side by side, width R each."""
        self.name = name
        self.batch = batch
        self.width = batch.rank * pieces  # a slot's columns
        weight = linear.weight
        shards = weight_shards(weight)
        self.row_shards: tuple[DimShard, ...] = tuple(s for s in shards if s.dim == 0)
        self.col_shards: tuple[DimShard, ...] = tuple(s for s in shards if s.dim == 1)
        self.reduce_a = bool(self.col_shards)
        if self.reduce_a and not hasattr(linear, "reduce_results"):
            raise ValueError(f"{name} splits its input over the ranks without a reduce_results attribute.")
        reduces = bool(getattr(linear, "reduce_results", True))
        self.adds = not self.reduce_a or reduces or get_tensor_model_parallel_rank() == 0
        out_local, in_local = int(linear.out_features), int(linear.in_features)
        self.a = torch.zeros(batch.slots * self.width, in_local, dtype=dtype, device=weight.device)
        self.b = torch.zeros(out_local, batch.slots * self.width, dtype=dtype, device=weight.device)
        self.handle = linear.register_forward_hook(self._hook)

    @property
    def nbytes(self) -> int:
        return self.a.numel() * self.a.element_size() + self.b.numel() * self.b.element_size()

    def write(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Slot `slot` holds (a [r, in_local], b [out_local, r] with the scaling in it; r at most the
        slot's width), or zeros."""
        rows = slice(slot * self.width, (slot + 1) * self.width)
        self.a[rows].zero_()
        self.b[:, rows].zero_()
        if a is not None:
            r = a.shape[0]
            self.a[rows][:r].copy_(a, non_blocking=True)
            self.b[:, rows][:, :r].copy_(b, non_blocking=True)

    def _hook(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        mask = self.batch.mask
        if mask is None:
            return None
        x = args[0]
        if x.shape[0] != mask.shape[0]:
            raise RuntimeError(
                f"LoRA: {self.name} ran on {x.shape[0]} rows of a batch of {mask.shape[0]} tokens."
            )
        w, lo, hi = self.width, self.batch.lo, self.batch.hi
        h = F.linear(x, self.a[lo * w : hi * w])
        if self.reduce_a:
            h = get_tp_group().all_reduce(h)
        h = (h.view(-1, hi - lo, w) * mask[:, :, None]).view(-1, (hi - lo) * w)
        if not self.adds:
            return None
        return out + F.linear(h, self.b[:, lo * w : hi * w])

    def remove(self) -> None:
        self.handle.remove()

