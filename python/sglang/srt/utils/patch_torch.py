"""`monkey_patch_torch_reductions`, at upstream's import path: CUDA tensors pickled by IPC handle name
their GPU by UUID rather than by index, so that a trainer and a server that number the GPUs differently
(each its own CUDA_VISIBLE_DEVICES) open the handle on the same physical GPU. Trainers call it before
`MultiprocessingSerializer.serialize`; the server's unpickling allowlist admits its rebuild function."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.multiprocessing import reductions

# The device's place among `rebuild_cuda_tensor`'s arguments (tensor_cls, size, stride, offset,
# storage_cls, dtype, storage_device, ...).
_DEVICE_ARG = 6


def monkey_patch_torch_reductions() -> None:
    """Make this process pickle CUDA tensors with the device's UUID (idempotent)."""
    if getattr(reductions, "_sglang_uuid_patched", False):
        return
    reductions._reduce_tensor_original = reductions.reduce_tensor
    reductions._rebuild_cuda_tensor_original = reductions.rebuild_cuda_tensor
    reductions.reduce_tensor = _reduce_tensor_by_uuid
    reductions.rebuild_cuda_tensor = _rebuild_cuda_tensor_by_uuid
    reductions.init_reductions()  # registers the (now patched) reduce_tensor with ForkingPickler
    reductions._sglang_uuid_patched = True


def _reduce_tensor_by_uuid(tensor: torch.Tensor) -> tuple[Callable, tuple]:
    # (torch's reduce_tensor names the module's rebuild_cuda_tensor, which the patch made ours; a sparse
    # CUDA tensor is rebuilt otherwise, with no device among its arguments)
    rebuild, args = reductions._reduce_tensor_original(tensor)
    torch_rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    if rebuild in (_rebuild_cuda_tensor_by_uuid, torch_rebuild):
        return _rebuild_cuda_tensor_by_uuid, _with_device(args, device_uuid(args[_DEVICE_ARG]))
    return rebuild, args


def _rebuild_cuda_tensor_by_uuid(*args: Any) -> torch.Tensor:
    """A CUDA tensor from its IPC handle, on the local GPU whose UUID (or index) the sender gave."""
    rebuild = getattr(reductions, "_rebuild_cuda_tensor_original", reductions.rebuild_cuda_tensor)
    return rebuild(*_with_device(args, device_index(args[_DEVICE_ARG])))


# Upstream's name for it, which payloads from upstream's patch carry.
_rebuild_cuda_tensor_modified = _rebuild_cuda_tensor_by_uuid


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def device_index(device: int | str) -> int:
    """The local index of a GPU named by index (as is) or by UUID; ValueError for a UUID not here."""
    if isinstance(device, int):
        return device
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == device:
            return index
    raise ValueError(f"no GPU here has the UUID {device!r} the tensor was sent from")


def _with_device(args: tuple, device: int | str) -> tuple:
    return (*args[:_DEVICE_ARG], device, *args[_DEVICE_ARG + 1 :])
