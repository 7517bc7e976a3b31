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

Nothing a payload asks for may take more memory than the payload itself: `_codecs.encode` is allowed only
as pickle protocol 2 writes bytes (a str and "latin1"; "hex" doubles a value per call, and chained calls
took a 2 KB body to gigabytes), a plain pickle's storages are read here rather than by `torch.load` (which
allocates whatever size a storage declares, and inflates a zip archive's compressed records ~1000:1), and
a tensor may not reach past its storage (torch would grow the storage to fit). Over one payload the
encoded bytes, and the storage bytes, each add up to at most the payload's length.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import re
import struct
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler


class UnsafePayloadError(ValueError):
    """The payload names something other than tensors and their parts."""


_REDUCTIONS = "torch.multiprocessing.reductions"
_PATCH = "sglang.srt.utils.patch_torch"
_ALLOWED = {
    (_REDUCTIONS, "rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_typed_storage_child"),
    (_REDUCTIONS, "rebuild_storage_empty"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch", "device"),
    ("torch.storage", "UntypedStorage"),
    ("torch.storage", "TypedStorage"),  # the storage class torch's CUDA reduction names
    ("torch.nn.parameter", "Parameter"),
    ("collections", "OrderedDict"),  # a plain pickle's (empty) backward hooks
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


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, trusted: bool, size: int):
        super().__init__(file)
        self.trusted = trusted
        self.size = size
        self.encoded_left = size  # bytes `_codecs.encode` may still make
        self.storage_left = size  # bytes storages read from the payload may still take

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key == ("torch.storage", "_load_from_bytes"):
            return self._storage_from_bytes
        if key == ("_codecs", "encode"):
            return self._latin1_bytes
        if key in _REBUILDS:
            return _REBUILDS[key]
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

    def _latin1_bytes(self, text: Any, encoding: Any = None) -> bytes:
        """`_codecs.encode` in the one shape protocol 2 writes bytes in: `encode(str, "latin1")`."""
        if not isinstance(text, str) or encoding != "latin1":
            raise UnsafePayloadError(
                'it calls _codecs.encode other than as pickle writes bytes (with a str and "latin1")'
            )
        self.encoded_left -= len(text)
        if self.encoded_left < 0:
            raise UnsafePayloadError(f"its bytes add up to more than the payload's own {self.size}")
        return text.encode("latin1")

    def _storage_from_bytes(self, data: Any) -> torch.storage.TypedStorage:
        if not isinstance(data, bytes):
            raise UnsafePayloadError("its storage is not bytes")
        return _read_legacy_storage(data, self._take_storage_bytes)

    def _take_storage_bytes(self, nbytes: int) -> None:
        # A memoized storage blob can be loaded again and again by reference: each load counts.
        self.storage_left -= nbytes
        if self.storage_left < 0:
            raise UnsafePayloadError(f"its storages add up to more bytes than the payload's own {self.size}")


# torch.save's legacy format, the one `Storage.__reduce__` writes: five pickles (magic number, format
# version, system info, the storage as a persistent id, its key), then the storage's element count (int64)
# and bytes. torch writes nothing else into `_load_from_bytes`; in particular never a zip archive.
_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_VERSION = 1001
_NOT_TORCHS = "its storage is not one torch.save wrote"


class _StorageRef:
    def __init__(self, pid: Any):
        if not (
            isinstance(pid, tuple)
            and len(pid) == 6
            and pid[0] == "storage"
            and isinstance(pid[1], torch.dtype)
            and isinstance(pid[2], str)
            and isinstance(pid[3], str)
            and isinstance(pid[4], int)
            and pid[4] >= 0
            and pid[5] is None  # (torch writes no views)
        ):
            raise UnsafePayloadError(_NOT_TORCHS)
        _, self.dtype, self.key, self.location, self.numel, _ = pid


class _StorageHeader(pickle.Unpickler):
    """The legacy format's pickles: plain values, a storage class (read as its dtype) and one storage."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and name.endswith("Storage"):
            try:
                return torch.serialization.StorageType(name).dtype
            except KeyError:
                pass
        raise UnsafePayloadError(f"its storage names {module}.{name}, which is not a storage class")

    def persistent_load(self, pid: Any) -> _StorageRef:
        return _StorageRef(pid)


def _read_legacy_storage(data: bytes, take: Callable[[int], None]) -> torch.storage.TypedStorage:
    """The storage `torch.storage._load_from_bytes` would load, its size checked against `data` (and
    `take`n) before anything is allocated."""
    if data[:2] == b"PK":
        raise UnsafePayloadError(f"{_NOT_TORCHS} (a zip archive, whose records torch would inflate)")
    f = io.BytesIO(data)
    magic, version, info, ref, keys = (_StorageHeader(f).load() for _ in range(5))
    little = isinstance(info, dict) and info.get("little_endian") is True
    if (magic, version) != (_LEGACY_MAGIC, _LEGACY_VERSION) or not little or not isinstance(ref, _StorageRef):
        raise UnsafePayloadError(_NOT_TORCHS)
    nbytes = ref.numel * torch._utils._element_size(ref.dtype)
    count = f.read(8)
    if keys != [ref.key] or len(count) != 8 or struct.unpack("<q", count)[0] != ref.numel:
        raise UnsafePayloadError(_NOT_TORCHS)
    if nbytes != len(data) - f.tell():
        raise UnsafePayloadError(f"its storage declares {nbytes} bytes and holds {len(data) - f.tell()}")
    take(nbytes)
    raw = f.read()
    untyped = torch.UntypedStorage.from_buffer(raw, dtype=torch.uint8) if raw else torch.UntypedStorage()
    untyped = torch.serialization.default_restore_location(untyped, ref.location)
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=ref.dtype, _internal=True)


def _check_extent(storage: Any, offset: Any, size: Any, stride: Any) -> None:
    """A tensor's elements must lie in its storage: torch grows a storage to fit a larger view, so a
    4-byte storage with size (2**32,) would allocate 16 GiB."""
    if not isinstance(storage, torch.storage.TypedStorage):
        raise UnsafePayloadError("its tensor's storage is not a storage")
    ints = (offset, *size, *stride)
    if not all(isinstance(v, int) and v >= 0 for v in ints) or len(size) != len(stride):
        raise UnsafePayloadError("its tensor's offset, size and stride are not non-negative integers")
    end = 0 if 0 in size else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))
    elements = storage._size()  # (size() warns that TypedStorage is deprecated)
    if end > elements:
        raise UnsafePayloadError(f"its tensor reaches element {end} of a storage of {elements}")


def _rebuild_tensor_v2(storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> torch.Tensor:
    _check_extent(storage, offset, size, stride)
    return torch._utils._rebuild_tensor_v2(storage, offset, size, stride, *rest)


def _rebuild_shared_tensor(cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
    from torch.multiprocessing.reductions import rebuild_tensor

    if not (isinstance(metadata, tuple) and len(metadata) == 4):
        raise UnsafePayloadError("its tensor's metadata is not torch's")
    _check_extent(storage, *metadata[:3])
    return rebuild_tensor(cls, storage, metadata)


_REBUILDS = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
    (_REDUCTIONS, "rebuild_tensor"): _rebuild_shared_tensor,
}


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
            return _TensorUnpickler(io.BytesIO(data), trusted, len(data)).load()
        except UnsafePayloadError:
            raise
        except Exception as e:  # noqa: BLE001 - any malformed payload is one error for the client
            raise ValueError(f"it does not unpickle: {type(e).__name__}: {e}") from None
