"""Per-batch metadata of the linear-attention backends (`mamba_backend_base`): the extend sequences and
their snapshots, the decode and verify rows, and the host lists and index tensors built from them once a
batch (moved to the device in one copy, or taken from the batch's prepared auxiliary tensors)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.layers.attention.fla_chunks import chunk_layout_host, chunk_offsets
from sglang.srt.layers.gpu_ops import triton_chosen
from sglang.srt.utils.host_tensors import host_int64, move_to_device

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch


@dataclass
class Snapshot:
    slot: int
    offset: int  # tokens of the extend the snapshot covers (S - P)
    chunk: int | None  # intermediate state index; None: the final state


@dataclass
class ExtendSeq:
    start: int
    length: int
    prefix: int
    slot: int
    tracks: list[Snapshot] = field(default_factory=list)

    @property
    def tokens(self) -> slice:
        return slice(self.start, self.start + self.length)


@dataclass
class LinearMetadata:
    slots: torch.Tensor | None = None  # [bs] running slots
    # A verify step with the Triton steps: the slots the states are read from (`slots`: written).
    src_slots: torch.Tensor | None = None
    extend: list[ExtendSeq] | None = None
    # Decode: (running slots, track slots, track mask), all [bs]; None when no row tracks.
    track_rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # Extend through the C++ ops: (cu_seqlens, running slots, snap_ptr, snap_offset, snap_slot), int64.
    cpu_extend: tuple[torch.Tensor, ...] | None = None
    # Extend conv through the Triton kernels: (cu_seqlens, running slots, (snap_seq, snap_offset,
    # snap_slot)) on the device, and the longest extend (a host int, for the grid).
    triton_extend: tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], int] | None = None
    # Extend through a packed-batch kernel (`varlen_impl`).
    varlen: VarlenExtend | None = None
    # Speculative verify: one step per position (`forward_verify`), and the batch's tokens in position
    # order (all requests' first tokens, then their second ones, ...: each step's inputs are a slice).
    verify: list[VerifyStep] | None = None
    verify_order: torch.Tensor | None = None


@dataclass
class VerifyStep:
    """Position t of a verify forward: its tokens' rows [lo, hi) of the position-ordered batch (of the
    requests that have a token at t), the slots their states before it are read from, and the verify
    rows their states after it go to."""

    lo: int
    hi: int
    src: torch.Tensor
    dst: torch.Tensor


@dataclass
class VarlenExtend:
    """A whole extend batch for kernels over packed sequences (`cu_seqlens`) that return each
    sequence's final state and its states at chunk starts (`linear/gdn_varlen.py`, `mamba/ssd_varlen.py`
    have the contract): which of those states each snapshot slot takes. Index tensors on the device."""

    cu_seqlens: torch.Tensor  # [N + 1]
    cu_seqlens_cpu: list[int]
    # Intermediate snapshots: chunk-state rows -> slots; final-state snapshots: sequences -> slots.
    chunk_rows: torch.Tensor
    chunk_slots: torch.Tensor
    final_rows: torch.Tensor
    final_slots: torch.Tensor
    # FLA's chunk layout of the batch at the kernel's chunk (`layers/attention/fla_chunks.py`).
    chunk_indices: torch.Tensor  # [NT, 2]
    chunk_offsets: torch.Tensor  # [N + 1]


def extend_layout(seqs: list[ExtendSeq]) -> tuple[list[int], list[int], list[tuple[int, int, int]]]:
    """(cu_seqlens, running slots, snapshots as (sequence, offset, slot) sorted by sequence then offset):
    what both batched extend paths describe a batch with. Sequences lie back to back from token 0."""
    cu, snaps = [0], []
    for i, seq in enumerate(seqs):
        assert seq.start == cu[-1], "extend sequences are laid out back to back"
        cu.append(seq.start + seq.length)
        snaps += sorted((i, t.offset, t.slot) for t in seq.tracks)
    return cu, [s.slot for s in seqs], snaps


def cpu_extend_args(seqs: list[ExtendSeq]) -> tuple[torch.Tensor, ...]:
    """The C++ extend ops' description: (cu_seqlens, slots, snap_ptr, snap_offset, snap_slot), with each
    sequence's snapshots behind snap_ptr."""
    cu, slots, snaps = extend_layout(seqs)
    ptr = [0] * (len(seqs) + 1)
    for seq_index, _, _ in snaps:
        ptr[seq_index + 1] += 1
    ptr = list(itertools.accumulate(ptr))
    return (
        host_int64(cu),
        host_int64(slots),
        host_int64(ptr),
        host_int64([o for _, o, _ in snaps]),
        host_int64([s for _, _, s in snaps]),
    )


# `ForwardBatch.aux_tensors` names of the extend index tensors (`prepare_host_metadata`).
TRITON_KEYS = tuple(f"linear.conv.{name}" for name in ("cu", "slots", "snap_seq", "snap_offset", "snap_slot"))
VARLEN_KEYS = tuple(
    f"linear.varlen.{name}"
    for name in (
        "cu",
        "chunk_rows",
        "chunk_slots",
        "final_rows",
        "final_slots",
        "chunk_indices",
        "chunk_offsets",
    )
)


def verify_widths(fb: ForwardBatch) -> list[int]:
    """How many requests of a verify have a token at each position."""
    lens = fb.extend_seq_lens_cpu
    return [sum(n > t for n in lens) for t in range(max(lens, default=0))]


def verify_keys(fb: ForwardBatch) -> tuple[str, ...]:
    """`ForwardBatch.aux_tensors` names of a verify's tensors (`_verify_host`'s order)."""
    width = max(fb.extend_seq_lens_cpu, default=0)
    steps = (f"linear.verify.{t}.{name}" for t in range(width) for name in ("src", "dst"))
    return ("linear.verify.order", *steps)


def moved_args(keys: tuple[str, ...], aux: dict[str, torch.Tensor], host: Any, device: torch.device) -> list:
    """The tensors `keys` as moved with the batch, or (not prepared, or prepared after the batch moved)
    `host()` moved in a copy of their own."""
    if keys[0] in aux and aux[keys[0]].device == device:
        return [aux[k] for k in keys]
    return move_to_device(host(), device)


def triton_extend_host(seqs: list[ExtendSeq]) -> list[torch.Tensor]:
    """The Triton conv's description on the host: cu_seqlens, slots, then the snapshots' (sequence,
    offset, slot) columns."""
    cu, slots, snaps = extend_layout(seqs)
    columns = [[e[k] for e in snaps] for k in range(3)]
    return [host_int64(v) for v in (cu, slots, *columns)]


def triton_extend_args(
    seqs: list[ExtendSeq], aux: dict[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...], int]:
    """The Triton conv's description on the device: (cu_seqlens, slots, (snap_sequence, snap_offset,
    snap_slot), the longest extend)."""
    moved = moved_args(TRITON_KEYS, aux, lambda: triton_extend_host(seqs), device)
    return moved[0], moved[1], tuple(moved[2:]), max((s.length for s in seqs), default=0)


def varlen_host(seqs: list[ExtendSeq], chunk_size: int) -> list[torch.Tensor]:
    """`VarlenExtend`'s index tensors on the host: cu_seqlens, then the intermediate snapshots' (chunk
    row, slot) and the final-state snapshots' (sequence, slot) columns, then FLA's chunk layout."""
    cu = list(itertools.accumulate((s.length for s in seqs), initial=0))
    first = chunk_offsets(cu, chunk_size)
    inter, final = [], []
    for i, seq in enumerate(seqs):
        for t in seq.tracks:
            if t.chunk is None:
                final.append((i, t.slot))
            else:
                # t.offset is a multiple of the kernel chunk, which chunk_size divides.
                inter.append((first[i] + t.offset // chunk_size, t.slot))
    columns = [[r for r, _ in inter], [s for _, s in inter], [r for r, _ in final], [s for _, s in final]]
    return [host_int64(cu), *(host_int64(c) for c in columns), *chunk_layout_host(cu, chunk_size, first)]


def varlen_args(
    seqs: list[ExtendSeq], chunk_size: int, aux: dict[str, torch.Tensor], device: torch.device
) -> VarlenExtend:
    """`VarlenExtend` of the batch, its index tensors on the device."""
    moved = moved_args(VARLEN_KEYS, aux, lambda: varlen_host(seqs, chunk_size), device)
    cu = list(itertools.accumulate((s.length for s in seqs), initial=0))
    return VarlenExtend(moved[0], cu, *moved[1:])


def decode_uses_triton(device: torch.device, choice_var: Any) -> bool:
    """Whether the decode step runs the Triton kernels (`gpu_ops.triton_chosen`'s rule)."""
    return triton_chosen(
        choice_var, device,
        "sglang.srt.layers.attention.linear.gdn_decode_triton", "sglang.srt.layers.attention.mamba.decode_triton",
    )  # fmt: skip
