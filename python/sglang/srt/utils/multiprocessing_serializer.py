"""`MultiprocessingSerializer`, at upstream's name: how `/update_weights_from_tensor` carries tensors.

`serialize` pickles with torch's multiprocessing reductions (`ForkingPickler`), as upstream's does: a CPU
tensor travels as a handle to shared memory (a file descriptor, or a file name under torch's
`file_system` sharing strategy), a CUDA tensor as a CUDA IPC handle; nothing is copied. Plain pickles of
tensors (by value) load too: the way to send CPU tensors from a process that does not share memory with
the server (a file descriptor reaches only a process started by the sender, such as an `Engine`'s
scheduler).

`deserialize` unpickles through an allowlist: tensors, storages, shapes, dtypes, torch's rebuild
functions (and `monkey_patch_torch_reductions`' one) and a tensor bucket's metadata, nothing else. A
body that names any other callable is refused before it is called, so a client cannot run code on the
server by sending weights (upstream unpickles them as they come). `trusted=False` (the HTTP route's)
also refuses shared memory the payload names (a file descriptor, whose following means connecting to an
address the payload names; a file under /dev/shm, which torch would open, grow and delete), and a CUDA
tensor's reference counter anywhere but in one of torch's counter files.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import re
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler


class UnsafePayloadError(ValueError):
    """The payload names something other than tensors and their parts."""


_REDUCTIONS = "torch.multiprocessing.reductions"
_PATCH = "sglang.srt.utils.patch_torch"
_ALLOWED = {
    (_REDUCTIONS, "rebuild_tensor"),
    (_REDUCTIONS, "rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_typed_storage_child"),
    (_REDUCTIONS, "rebuild_storage_empty"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch", "device"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),  # the storage class torch's CUDA reduction names
    ("torch.nn.parameter", "Parameter"),
    ("collections", "OrderedDict"),  # a plain pickle's (empty) backward hooks
    ("_codecs", "encode"),  # how pickle protocol 2 writes bytes
    ("__builtin__", "bytes"),  # and empty ones
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),  # the flattened_bucket format
}
# CUDA tensors by IPC handle: torch's rebuild, and monkey_patch_torch_reductions' (ours, upstream's name).
_CUDA = {(_REDUCTIONS, "rebuild_cuda_tensor"), (_PATCH, "_rebuild_cuda_tensor_by_uuid"),
         (_PATCH, "_rebuild_cuda_tensor_modified")}  # fmt: skip
# Shared memory the payload names (a file descriptor, a file under /dev/shm): only from a trusted sender.
_SHARED_FILES = {
    (_REDUCTIONS, "rebuild_storage_fd"),
    ("multiprocessing.resource_sharer", "DupFd"),
    (_REDUCTIONS, "rebuild_storage_filename"),
}
# A CUDA tensor's reference counter lives in a shared file torch names /torch_<numbers> and sizes for
# this many counters; an untrusted payload may name no other file, nor an offset past it.
_REF_COUNTER_NAME = re.compile(rb"/torch_[0-9_]+")
_REF_COUNTERS = 10000
_TENSOR_CLASSES = (torch.Tensor, torch.nn.Parameter)
_STORAGE_CLASSES = (torch.storage.TypedStorage, torch.UntypedStorage)


def _load_storage_bytes(data: bytes) -> Any:
    """`torch.storage._load_from_bytes` (a plain pickle's storages) without its unrestricted unpickling."""
    return torch.load(io.BytesIO(data), weights_only=True)


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, trusted: bool):
        super().__init__(file)
        self.trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key == ("torch.storage", "_load_from_bytes"):
            return _load_storage_bytes
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if key in _CUDA:
            return _rebuild_cuda_tensor if self.trusted else _rebuild_cuda_tensor_checked
        if key == ("__builtin__", "bytes"):
            return _empty_bytes
        if key in _ALLOWED or (self.trusted and key in _SHARED_FILES):
            return super().find_class(module, name)
        if key in _SHARED_FILES:
            raise UnsafePayloadError(
                "the tensors travel as shared memory of the sender's, which the server opens only for a "
                "process that started it (an Engine's): over HTTP send them by value (pickle.dumps) or as "
                "CUDA tensors"
            )
        raise UnsafePayloadError(f"it names {module}.{name}, which is not part of a tensor")


def _empty_bytes() -> bytes:
    """How protocol 2 writes b"" (`bytes()`); a payload may not make it allocate (`bytes(n)`)."""
    return b""


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """A CUDA tensor from its IPC handle, on the GPU the sender named by index or by UUID."""
    from sglang.srt.utils.patch_torch import _rebuild_cuda_tensor_by_uuid

    return _rebuild_cuda_tensor_by_uuid(*args)


def _rebuild_cuda_tensor_checked(*args: Any) -> torch.Tensor:
    """`_rebuild_cuda_tensor` for an untrusted payload: its reference counter must be one of torch's
    files at an offset within it (torch decrements the counter there when the tensor is freed)."""
    if len(args) != 15 or args[0] not in _TENSOR_CLASSES or args[4] not in _STORAGE_CLASSES:
        raise UnsafePayloadError("its CUDA tensor is not torch's (tensor class, storage class, arguments)")
    handle, offset = args[11], args[12]
    if not (isinstance(handle, bytes) and _REF_COUNTER_NAME.fullmatch(handle)):
        raise UnsafePayloadError("its CUDA tensor names a reference counter that is not torch's")
    if not (isinstance(offset, int) and 0 <= offset < _REF_COUNTERS):
        raise UnsafePayloadError("its CUDA tensor's reference counter offset is out of range")
    return _rebuild_cuda_tensor(*args)


class MultiprocessingSerializer:
    @staticmethod
    def serialize(obj: Any, output_str: bool = False) -> bytes | str:
        """`obj` pickled with torch's multiprocessing reductions; base64 text with `output_str` (for JSON)."""
        buf = io.BytesIO()
        ForkingPickler(buf).dump(obj)
        data = buf.getvalue()
        return base64.b64encode(data).decode() if output_str else data

    @staticmethod
    def deserialize(data: bytes | str, trusted: bool = True) -> Any:
        """What `serialize` (or a plain pickle of tensors) made, through the allowlist; base64 text too.
        ValueError (`UnsafePayloadError` for a name outside the allowlist) where it is not that."""
        if isinstance(data, str):
            try:
                data = base64.b64decode(data, validate=True)
            except (binascii.Error, ValueError):
                raise ValueError("it is not valid base64") from None
        try:
            return _TensorUnpickler(io.BytesIO(data), trusted).load()
        except UnsafePayloadError:
            raise
        except Exception as e:  # noqa: BLE001 - any malformed payload is one error for the client
            raise ValueError(f"it does not unpickle: {type(e).__name__}: {e}") from None
