"""Triton state-copy kernel, the GPU default: one launch per op over every row, state tensor and layer.

The pool's tensors are addressed from one base pointer (the first tensor's storage) plus int64 word
offsets from a small table built once per pool, so tensors of different dtypes share the launch: the
kernel moves words of the widest type that divides every address, stride and row length (int64, in
pairs when everything is 16-byte aligned, which the pools are). Grid: (tiles of one row over all
tensors and layers, rows). Each program moves one tile of BLOCK words of one row; rows that are not
kept (see `StateCopier`) are masked out and move nothing.

On CPU tensors the kernel runs only under `TRITON_INTERPRET=1` (slowly: tests on tiny shapes). The
jitted kernel is made on first use, so the interpreter setting at that time decides.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton.language as tl

from sglang.srt.mem_cache.state_copy.layout import StateLayout, describe
from sglang.srt.utils.triton_jit import jit_for_env

BLOCK = 2048  # words per program (16 KB of int64)
NUM_WARPS = 8
MAX_ROWS_PER_LAUNCH = 65535  # the CUDA grid's y limit
_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}
# Table columns: tile_start, tiles_per_layer, offset, layer_stride, slot_stride, row_len (in VEC words).
TABLE_COLS = tl.constexpr(6)


def _state_copy_kernel(
    base_ptr,
    table_ptr,
    src_ptr,
    dst_ptr,
    mask_ptr,
    num_slots,
    NUM_TENSORS: tl.constexpr,
    VEC: tl.constexpr,
    BLOCK: tl.constexpr,
    IS_CLEAR: tl.constexpr,
    HAS_MASK: tl.constexpr,
):
    tile = tl.program_id(0).to(tl.int64)
    row = tl.program_id(1)
    d = tl.load(dst_ptr + row)
    keep = (d > 0) & (d < num_slots)
    s = d
    if not IS_CLEAR:
        s = tl.load(src_ptr + row)
        keep = keep & (s >= 0) & (s < num_slots) & (s != d)
    if HAS_MASK:
        keep = keep & (tl.load(mask_ptr + row) != 0)
    # The tensor this tile belongs to: the last one whose first tile is <= tile.
    start = tl.load(table_ptr)
    per_layer = tl.load(table_ptr + 1)
    offset = tl.load(table_ptr + 2)
    layer_stride = tl.load(table_ptr + 3)
    slot_stride = tl.load(table_ptr + 4)
    row_len = tl.load(table_ptr + 5)
    for k in tl.static_range(1, NUM_TENSORS):
        hit = tile >= tl.load(table_ptr + k * TABLE_COLS)
        start = tl.where(hit, tl.load(table_ptr + k * TABLE_COLS), start)
        per_layer = tl.where(hit, tl.load(table_ptr + k * TABLE_COLS + 1), per_layer)
        offset = tl.where(hit, tl.load(table_ptr + k * TABLE_COLS + 2), offset)
        layer_stride = tl.where(hit, tl.load(table_ptr + k * TABLE_COLS + 3), layer_stride)
        slot_stride = tl.where(hit, tl.load(table_ptr + k * TABLE_COLS + 4), slot_stride)
        row_len = tl.where(hit, tl.load(table_ptr + k * TABLE_COLS + 5), row_len)
    j = tile - start
    layer = j // per_layer
    layer_base = (offset + layer * layer_stride) * VEC
    words = tl.arange(0, BLOCK) + (j % per_layer) * BLOCK
    # A row that is not kept gets length 0 (one compare; `tensor & scalar` also trips the interpreter).
    m = words < tl.where(keep, row_len * VEC, 0)
    to = base_ptr + (layer_base + d.to(tl.int64) * slot_stride * VEC) + words
    if IS_CLEAR:
        # tl.full, not tl.zeros: the latter is a jitted helper, which the interpreter refuses when
        # triton.language was imported before TRITON_INTERPRET was set (one pytest process).
        tl.store(to, tl.full([BLOCK], 0, base_ptr.dtype.element_ty), mask=m)
    else:
        frm = base_ptr + (layer_base + s.to(tl.int64) * slot_stride * VEC) + words
        tl.store(to, tl.load(frm, mask=m), mask=m)


def kernel():
    """The jitted kernel for the current `TRITON_INTERPRET` setting."""
    return jit_for_env(_state_copy_kernel)


def build_table(lay: StateLayout, block: int = BLOCK) -> tuple[torch.dtype, int, list[list[int]], int]:
    """(word dtype, VEC, table rows, tiles per row) for a layout; table values are in units of VEC words
    and addresses are relative to the first tensor."""
    align = lay.alignment(16)
    word = min(align, 8)
    vec = align // word
    rows, start = [], 0
    for k in range(len(lay.addr)):
        row_words = lay.row_bytes[k] // word
        per_layer = -(-row_words // block)
        rows.append(
            [
                start,
                max(per_layer, 1),
                (lay.addr[k] - lay.addr[0]) // align,
                lay.layer_stride[k] // align,
                lay.slot_stride[k] // align,
                lay.row_bytes[k] // align,
            ]
        )
        start += lay.num_layers[k] * per_layer
    return _WORD[word], vec, rows, start


class TritonStateCopy:
    name = "triton"

    def __init__(self, tensors: Sequence[torch.Tensor]):
        lay = describe(tensors)
        word, self._vec, rows, self._tiles = build_table(lay)
        first = tensors[0]
        # A word view starting at the first tensor's data (the kernel's base pointer). Its size is
        # nominal: the kernel addresses every tensor from here by offset.
        nbytes = first.untyped_storage().nbytes() - first.storage_offset() * first.element_size()
        self._base = torch.empty(0, dtype=word, device=first.device).set_(
            first.untyped_storage(),
            first.storage_offset() * first.element_size() // word.itemsize,
            (nbytes // word.itemsize,),
        )
        self._table = torch.tensor(rows, dtype=torch.int64, device=first.device)
        self._num_tensors = len(rows)
        self._num_slots = lay.num_slots

    def _launch(self, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor | None, clear: bool) -> None:
        n = dst.numel()
        if n == 0 or self._tiles == 0:
            return
        for lo in range(0, n, MAX_ROWS_PER_LAUNCH):
            hi = min(n, lo + MAX_ROWS_PER_LAUNCH)
            d = dst[lo:hi]
            kernel()[(self._tiles, hi - lo)](
                self._base,
                self._table,
                src[lo:hi],
                d,
                d if mask is None else mask[lo:hi],
                self._num_slots,
                NUM_TENSORS=self._num_tensors,
                VEC=self._vec,
                BLOCK=BLOCK,
                IS_CLEAR=clear,
                HAS_MASK=mask is not None,
                num_warps=NUM_WARPS,
            )

    def warm_up(self) -> None:
        """Compile the three variants now (copy, clear, masked copy) with a row that moves nothing
        (destination 0): a compiler failure then shows at pool creation, not in a forward."""
        zero = torch.zeros(1, dtype=torch.int64, device=self._table.device)
        self.copy(zero, zero, None)
        self.clear(zero)
        self.copy(zero, zero, torch.ones(1, dtype=torch.bool, device=zero.device))

    def copy(self, src: torch.Tensor, dst: torch.Tensor, mask: torch.Tensor | None) -> None:
        self._launch(src, dst, mask, clear=False)

    def clear(self, slots: torch.Tensor) -> None:
        self._launch(slots, slots, None, clear=True)
