"""Mamba state-copy ops: copy, clear and the decode track copy of whole pool slots, over every layer
and state kind (conv and SSM, each in its own dtype) in one launch per op.

Semantics, the same for every implementation (`torch` reference, `cpp` = sgl-kernel C++/OpenMP for
CPU tensors, `triton` and `cuda` = sgl-kernel CUDA for GPU tensors):
- `copy(src, dst)`: for every kept row i, slot `dst[i]` of every state tensor and layer becomes a copy
  of slot `src[i]`. A row is kept when `src[i] >= 0`, `dst[i] > 0` and `src[i] != dst[i]`: -1 entries
  are skipped, the dummy slot 0 is never written, and copying a slot onto itself does nothing.
- `clear(slots)`: zero every slot > 0 of the list (bytes 0, i.e. +0.0 in each dtype).
- `track_copy(running, track, mask)`: `copy(running, track)` restricted to the rows where the bool
  tensor `mask` is true; the mask stays on the device (no host sync, a fixed-shape launch).
- Overlap is rejected, not ordered: among the kept rows of one call, destinations are distinct and no
  destination is another kept row's source. Ids given as host ints (lists) are checked and raise
  ValueError, as do ids past the pool; ids given as tensors are not checked (that would be a device
  sync), and breaking the rule then gives an unspecified result (CPU ops still raise on ids past the
  pool; GPU kernels skip them).

Which implementation runs: `SGLANG_MAMBA_STATE_COPY_BACKEND` (`auto` by default; `torch`, `cpp`,
`triton`, `cuda` force one and raise if it cannot run on the pool's device). `auto` picks the fastest
that runs, per device. CPU: cpp, else torch. CUDA: cuda where its build is cached (`python -m
sglang.srt.utils.sgl_kernel --cuda` makes it: the fastest on an H200, nearer a plain copy's bandwidth
than Triton's and much faster for a 1-slot copy: benchmark/gpu/README.md), else triton, else
cuda (built on first use, ~1 minute), else torch. A kernel that cannot be built or imported is reported
by one warning and the next one is used.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.state_copy.layout import StateLayout, describe
from sglang.srt.mem_cache.state_copy.torch_impl import TorchStateCopy

logger = logging.getLogger(__name__)

IMPLS = ("torch", "cpp", "triton", "cuda")


def auto_order(device_type: str) -> tuple[str, ...]:
    """The implementations `auto` tries on a device, fastest first (the module docstring says why)."""
    if device_type == "cpu":
        return ("cpp", "torch")
    if device_type == "cuda":
        from sglang.srt.utils.sgl_kernel import is_built

        return ("cuda", "triton", "torch") if is_built("cuda") else ("triton", "cuda", "torch")
    return ("torch",)


Ids = Sequence[int] | torch.Tensor

_triton_failure: list[str] = []  # why the Triton kernel cannot run in this process (warned once)


def _make_triton(tensors: Sequence[torch.Tensor], device: torch.device):
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return (
            None,
            "Triton has no CPU backend (TRITON_INTERPRET=1 runs its kernels on CPU, slowly, for tests)",
        )
    if device.type not in ("cpu", "cuda"):
        return None, f"Triton does not run on {device.type}"
    if _triton_failure:
        return None, _triton_failure[0]
    try:
        from sglang.srt.mem_cache.state_copy.triton_impl import TritonStateCopy

        impl = TritonStateCopy(tensors)
        if device.type == "cuda":
            impl.warm_up()
        return impl, ""
    except Exception as e:  # noqa: BLE001 - no triton, or a compiler that fails: use another implementation
        _triton_failure.append(f"the Triton kernel cannot run ({type(e).__name__}: {e})")
        logger.warning("Triton state-copy kernel unavailable: %s; falling back.", _triton_failure[0])
        return None, _triton_failure[0]


def _make(name: str, tensors: Sequence[torch.Tensor], device: torch.device):
    """The implementation, or the reason it cannot run here."""
    if name == "torch":
        return TorchStateCopy(tensors), ""
    if name in ("cpp", "cuda"):
        kind = "cpu" if name == "cpp" else "cuda"
        if device.type != kind:
            return None, f"the {name} op works on {kind} tensors, the pool is on {device.type}"
        from sglang.srt.mem_cache.state_copy.native import NativeStateCopy
        from sglang.srt.utils.sgl_kernel import load_extension

        module, reason = load_extension(kind)
        return (NativeStateCopy(name, module, tensors), "") if module is not None else (None, reason)
    if name == "triton":
        return _make_triton(tensors, device)
    raise ValueError(
        f"SGLANG_MAMBA_STATE_COPY_BACKEND must be auto or one of {', '.join(IMPLS)}; got {name!r}."
    )


def select_impl(tensors: Sequence[torch.Tensor], requested: str | None = None):
    requested = requested or envs.SGLANG_MAMBA_STATE_COPY_BACKEND.get()
    device = tensors[0].device
    if requested != "auto":
        impl, reason = _make(requested, tensors, device)
        if impl is None:
            raise ValueError(f"SGLANG_MAMBA_STATE_COPY_BACKEND={requested} cannot run: {reason}.")
        return impl
    for name in auto_order(device.type):
        impl, _ = _make(name, tensors, device)
        if impl is not None:
            return impl
    raise AssertionError("the torch implementation is always available")


class StateCopier:
    """The state-copy ops bound to one pool's state tensors (`[num_layers, num_slots, *row]` each, rows
    contiguous). The implementation and its tables are chosen once, at construction."""

    def __init__(self, tensors: Sequence[torch.Tensor], impl: str | None = None):
        self.tensors = list(tensors)
        self.layout: StateLayout = describe(self.tensors)
        self.device = self.tensors[0].device
        self._impl = select_impl(self.tensors, impl)

    @property
    def impl(self) -> str:
        return self._impl.name

    def rebind(self) -> None:
        """Build the tables again from the tensors' addresses as they are now: their storages were freed
        and given back elsewhere (/resume_memory_occupation), and the tables hold raw addresses."""
        self.layout = describe(self.tensors)
        self._impl = select_impl(self.tensors, self.impl)

    def copy(self, src: Ids, dst: Ids) -> None:
        if len(src) != len(dst):
            raise ValueError(f"copy: {len(src)} sources for {len(dst)} destinations.")
        if len(dst) == 0:
            return
        if not isinstance(src, torch.Tensor) and not isinstance(dst, torch.Tensor):
            self._check_host_rows(src, dst)
            self._impl.copy(*self._host_ids(src, dst), None)
            return
        self._impl.copy(self._ids(src), self._ids(dst), None)

    def clear(self, slots: Ids) -> None:
        if len(slots) == 0:
            return
        if not isinstance(slots, torch.Tensor):
            self._check_range(slots)
        self._impl.clear(self._ids(slots))

    def track_copy(self, running: Ids, track: Ids, mask: torch.Tensor) -> None:
        """Copy `running[i] -> track[i]` for the rows where `mask[i]` (a bool tensor) is true."""
        if not len(running) == len(track) == mask.numel():
            raise ValueError(
                f"track_copy: {len(running)} running, {len(track)} track, {mask.numel()} mask rows."
            )
        if len(track) == 0:
            return
        mask = mask.to(device=self.device, dtype=torch.bool).contiguous()
        self._impl.copy(self._ids(running), self._ids(track), mask)

    def _ids(self, ids: Ids) -> torch.Tensor:
        if isinstance(ids, torch.Tensor):
            if ids.dtype == torch.int64 and ids.device == self.device and ids.is_contiguous():
                return ids
            return ids.to(device=self.device, dtype=torch.int64).contiguous()
        return self._host_ids(ids)[0]

    def _host_ids(self, *lists: Sequence[int]) -> list[torch.Tensor]:
        """Host id lists on the pool's device in one copy (pinned and non-blocking on CUDA)."""
        from sglang.srt.utils.host_tensors import move_to_device

        return move_to_device([torch.tensor(list(ids), dtype=torch.int64) for ids in lists], self.device)

    def _check_range(self, ids: Sequence[int]) -> None:
        bad = [i for i in ids if i >= self.layout.num_slots]
        if bad:
            raise ValueError(
                f"Slot ids {bad[:8]} are past the pool ({self.layout.num_slots} slots with the dummy)."
            )

    def _check_host_rows(self, src: Sequence[int], dst: Sequence[int]) -> None:
        self._check_range(src)
        self._check_range(dst)
        kept = [(s, d) for s, d in zip(src, dst, strict=True) if s >= 0 and d > 0 and s != d]
        dsts = [d for _, d in kept]
        if len(set(dsts)) != len(dsts):
            raise ValueError(f"copy: a destination slot appears twice in {dsts}.")
        clash = set(dsts) & {s for s, _ in kept}
        if clash:
            raise ValueError(f"copy: slots {sorted(clash)} are both a source and a destination.")


def mamba_state_copy(
    tensors: Sequence[torch.Tensor], src_slots: Ids, dst_slots: Ids, impl: str | None = None
) -> None:
    """One-shot `StateCopier(tensors, impl).copy(src_slots, dst_slots)`; pools keep a StateCopier."""
    StateCopier(tensors, impl).copy(src_slots, dst_slots)


def mamba_state_clear(tensors: Sequence[torch.Tensor], slots: Ids, impl: str | None = None) -> None:
    StateCopier(tensors, impl).clear(slots)


def mamba_state_track_copy(
    tensors: Sequence[torch.Tensor], running: Ids, track: Ids, mask: torch.Tensor, impl: str | None = None
) -> None:
    StateCopier(tensors, impl).track_copy(running, track, mask)


__all__ = [
    "IMPLS",
    "StateCopier",
    "mamba_state_clear",
    "mamba_state_copy",
    "mamba_state_track_copy",
    "select_impl",
]
