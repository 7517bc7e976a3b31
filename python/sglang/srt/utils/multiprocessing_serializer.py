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

Nothing a payload asks for may take more memory than the payload itself:
- the tensor and storage classes reach the payload as names only (`_ClassName`), which the rebuild
  functions read and nothing may call: `torch.Tensor(2**28)` is 1 GiB from a 31-byte pickle;
- pickle's BUILD (which sets the state of whatever object it is given) is refused on every tensor and
  storage the load makes, and on the functions it names, which outlive the payload:
  `Tensor.__setstate__` calls `set_`, which grows a storage to any size;
- `_codecs.encode` is allowed only as pickle protocol 2 writes bytes (a str and "latin1"; "hex" doubles a
  value per call, and chained calls took a 2 KB body to gigabytes);
- a plain pickle's storages are read here rather than by `torch.load` (which allocates whatever size a
  storage declares, and inflates a zip archive's compressed records ~1000:1);
- a tensor may not reach past its storage (torch would grow the storage to fit);
- over one payload the encoded bytes, and the storage bytes read, each add up to at most the payload's
  length, and (untrusted) so do the distinct storages of the tensors and storages the load returns,
  but for CUDA storages opened by IPC handle (the sender's memory, not allocated here).
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
import torch.multiprocessing.reductions as reductions

from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata


class UnsafePayloadError(ValueError):
    """The payload names something other than tensors and their parts."""


class _ClassName:
    """What a payload gets for a tensor or storage class: an argument for the rebuild functions, which
    read the class from it; calling it (`UntypedStorage(2**30)`) or BUILD on it is refused."""

    __slots__ = ("cls",)

    def __init__(self, cls: type):
        self.cls = cls

    def __call__(self, *args: Any) -> Any:
        raise UnsafePayloadError(f"it calls {self.cls.__name__}, which a payload may only name")

    def __setstate__(self, state: Any) -> None:
        _refuse_build(state)


class _Call:
    """An allowed function as the payload sees it: callable, but BUILD on it is refused (it would set
    attributes of the function, which outlives the payload)."""

    __slots__ = ("fn",)

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        return self.fn(*args)

    def __setstate__(self, state: Any) -> None:
        _refuse_build(state)


def _refuse_build(state: Any) -> None:
    raise UnsafePayloadError(
        "it sets the state of a tensor, a storage or a function (pickle's BUILD), which torch's tensors "
        "act on (Tensor.__setstate__ resizes the storage): torch's pickles never do"
    )


_REDUCTIONS = "torch.multiprocessing.reductions"
_PATCH = "sglang.srt.utils.patch_torch"
_TENSOR = _ClassName(torch.Tensor)
_PARAMETER = _ClassName(torch.nn.Parameter)
_UNTYPED = _ClassName(torch.UntypedStorage)
_TYPED = _ClassName(torch.storage.TypedStorage)  # the storage class torch's CUDA reduction names
_CLASS_NAMES = {
    ("torch", "Tensor"): _TENSOR,
    ("torch.nn.parameter", "Parameter"): _PARAMETER,
    ("torch.storage", "UntypedStorage"): _UNTYPED,
    ("torch.storage", "TypedStorage"): _TYPED,
}
# Classes whose instances are plain values (immutable types, or FlattenedTensorMetadata, whose own
# `__setstate__` takes its fields only).
_VALUES = {
    ("torch", "Size"),
    ("torch", "device"),
    ("collections", "OrderedDict"),  # a plain pickle's (empty) backward hooks
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),  # the flattened_bucket format
}
_DTYPES = {name for name in dir(torch) if isinstance(getattr(torch, name), torch.dtype)}
# CUDA tensors by IPC handle: torch's rebuild, and monkey_patch_torch_reductions' (ours, upstream's name).
_CUDA = {(_REDUCTIONS, "rebuild_cuda_tensor"), (_PATCH, "_rebuild_cuda_tensor_by_uuid"),
         (_PATCH, "_rebuild_cuda_tensor_modified")}  # fmt: skip
# Shared memory the payload names (a file descriptor, a file under /dev/shm): only from a trusted sender.
_SHARED_STORAGES = {(_REDUCTIONS, "rebuild_storage_fd"), (_REDUCTIONS, "rebuild_storage_filename")}
_DUP_FD = ("multiprocessing.resource_sharer", "DupFd")
# A CUDA tensor's reference counter lives in a shared file torch names /torch_<numbers> and sizes for
# this many counters; an untrusted payload may name no other file, nor an offset past it.
_REF_COUNTER_NAME = re.compile(rb"/torch_[0-9_]+")
_REF_COUNTERS = 10000


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, trusted: bool, size: int):
        super().__init__(file)
        self.trusted = trusted
        self.size = size
        self.encoded_left = size  # bytes `_codecs.encode` may still make
        self.storage_left = size  # bytes storages read from the payload may still take
        # The tensors and storages this load made, each with an instance `__setstate__` (which pickle's
        # BUILD looks up before the class's) that refuses, until the load ends (`release`).
        self.made: list[Any] = []
        self.storages: set[int] = set()  # the untyped storages made here (their `_cdata`)
        self.opened: dict[int, int] = {}  # CUDA storages opened by IPC handle: `_cdata` -> bytes
        self.calls = {
            ("torch.storage", "_load_from_bytes"): _Call(self._storage_from_bytes),
            ("_codecs", "encode"): _Call(self._latin1_bytes),
            ("__builtin__", "bytes"): _Call(_empty_bytes),
            ("torch._utils", "_rebuild_tensor_v2"): _Call(self._rebuild_tensor_v2),
            ("torch._utils", "_rebuild_parameter"): _Call(self._rebuild_parameter),
            (_REDUCTIONS, "rebuild_tensor"): _Call(self._rebuild_shared_tensor),
            (_REDUCTIONS, "rebuild_typed_storage"): _Call(self._rebuild_typed_storage),
            (_REDUCTIONS, "rebuild_storage_empty"): _Call(self._rebuild_storage_empty),
            **dict.fromkeys(_CUDA, _Call(self._rebuild_cuda_tensor)),
        }
        if trusted:
            for module, name in _SHARED_STORAGES:
                self.calls[module, name] = _Call(self._shared_storage(getattr(reductions, name)))

    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        if key in self.calls:
            return self.calls[key]
        if key in _CLASS_NAMES:
            return _CLASS_NAMES[key]
        if module == "torch" and name in _DTYPES:
            return getattr(torch, name)
        if key in _VALUES or (self.trusted and key == _DUP_FD):
            return super().find_class(module, name)
        if key in _SHARED_STORAGES or key == _DUP_FD:
            raise UnsafePayloadError(
                "the tensors travel as shared memory of the sender's, which the server opens only for a "
                "process that started it (an Engine's): over HTTP send them by value (pickle.dumps) or as "
                "CUDA tensors"
            )
        raise UnsafePayloadError(f"it names {module}.{name}, which is not part of a tensor")

    # ---- what the load made ----------------------------------------------------------------------

    def _made(self, obj: Any) -> Any:
        obj.__dict__["__setstate__"] = _refuse_build
        self.made.append(obj)
        return obj

    def _storage_made(self, storage: Any) -> Any:
        untyped = storage._untyped_storage if isinstance(storage, torch.storage.TypedStorage) else storage
        self.storages.add(untyped._cdata)
        if untyped is not storage:
            self._made(untyped)
        return self._made(storage)

    def _typed(self, storage: Any) -> torch.storage.TypedStorage:
        """`storage`, a typed storage whose bytes this load made (a payload can hold no other)."""
        if not (
            isinstance(storage, torch.storage.TypedStorage)
            and storage._untyped_storage._cdata in self.storages
        ):
            raise UnsafePayloadError("its tensor's storage is not a storage it sent")
        return storage

    def release(self) -> None:
        """The load's tensors and storages as torch made them (their BUILD guards gone)."""
        for obj in self.made:
            obj.__dict__.pop("__setstate__", None)
        self.made.clear()

    def check_storage_bytes(self, result: Any) -> None:
        """The distinct storages `result` holds add up to at most the payload's length (CUDA storages
        opened by IPC handle aside): a storage can grow after its tensor was checked against it (as
        `set_` grows it), and this holds whatever did."""
        held: dict[int, int] = {}
        seen: set[int] = set()
        todo = [result]
        while todo:  # (not recursive: a payload can nest lists deeper than Python's stack)
            obj = todo.pop()
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            if isinstance(obj, (list, tuple)):
                todo.extend(obj)
            elif isinstance(obj, dict):
                todo.extend(obj.keys())
                todo.extend(obj.values())
            elif isinstance(obj, FlattenedTensorMetadata):
                todo.extend(vars(obj).values())
            elif isinstance(obj, (torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage)):
                # (the classes' own methods: an instance attribute cannot stand in for them)
                if isinstance(obj, torch.Tensor):
                    untyped = torch.Tensor.untyped_storage(obj)
                elif isinstance(obj, torch.storage.TypedStorage):
                    untyped = obj._untyped_storage
                else:
                    untyped = obj
                nbytes = torch.UntypedStorage.nbytes(untyped)
                if self.opened.get(untyped._cdata) != nbytes:
                    held[untyped._cdata] = nbytes
        total = sum(held.values())
        if total > self.size:
            raise UnsafePayloadError(
                f"its tensors' storages hold {total} bytes, more than the payload's own {self.size}"
            )

    # ---- the allowed calls -------------------------------------------------------------------------

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
        return self._storage_made(_read_legacy_storage(data, self._take_storage_bytes))

    def _take_storage_bytes(self, nbytes: int) -> None:
        # A memoized storage blob can be loaded again and again by reference: each load counts.
        self.storage_left -= nbytes
        if self.storage_left < 0:
            raise UnsafePayloadError(f"its storages add up to more bytes than the payload's own {self.size}")

    def _rebuild_storage_empty(self, cls: Any) -> torch.UntypedStorage:
        """torch's pickle of an empty storage: its class, called with no arguments."""
        if cls is not _UNTYPED:
            raise UnsafePayloadError("its empty storage is not an UntypedStorage")
        return self._storage_made(torch.UntypedStorage())

    def _shared_storage(self, rebuild: Callable[..., Any]) -> Callable[..., Any]:
        """torch's `rebuild_storage_fd` / `_filename` (trusted payloads), given the class the name stands for."""

        def call(cls: Any, *args: Any) -> Any:
            if cls is not _UNTYPED:
                raise UnsafePayloadError("its shared storage is not an UntypedStorage")
            return self._storage_made(rebuild(torch.UntypedStorage, *args))

        return call

    def _rebuild_typed_storage(self, storage: Any, dtype: Any) -> torch.storage.TypedStorage:
        if not (isinstance(storage, torch.UntypedStorage) and storage._cdata in self.storages):
            raise UnsafePayloadError("its typed storage wraps something other than a storage it sent")
        if not isinstance(dtype, torch.dtype):
            raise UnsafePayloadError("its typed storage's dtype is not a dtype")
        return self._storage_made(
            torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
        )

    def _rebuild_tensor_v2(
        self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any
    ) -> torch.Tensor:
        """A plain pickle's tensor: (requires_grad, backward_hooks[, metadata]) follow its view."""
        _check_extent(self._typed(storage), offset, size, stride)
        if not (2 <= len(rest) <= 3 and isinstance(rest[0], bool) and _no_hooks(rest[1])):
            raise UnsafePayloadError("its tensor's requires_grad and hooks are not torch's")
        return self._made(torch._utils._rebuild_tensor_v2(storage, offset, size, stride, *rest))

    def _rebuild_parameter(self, data: Any, requires_grad: Any, backward_hooks: Any) -> torch.Tensor:
        if not (
            isinstance(data, torch.Tensor) and isinstance(requires_grad, bool) and _no_hooks(backward_hooks)
        ):
            raise UnsafePayloadError("its parameter is not a tensor with torch's requires_grad and hooks")
        return self._made(torch._utils._rebuild_parameter(data, requires_grad, backward_hooks))

    def _rebuild_shared_tensor(self, cls: Any, storage: Any, metadata: Any) -> torch.Tensor:
        """torch's multiprocessing pickle of a CPU tensor (its storage shared, or empty)."""
        if cls not in (_TENSOR, _PARAMETER):
            raise UnsafePayloadError("its tensor's class is not Tensor or Parameter")
        if not (isinstance(metadata, tuple) and len(metadata) == 4 and isinstance(metadata[3], bool)):
            raise UnsafePayloadError("its tensor's metadata is not torch's")
        _check_extent(self._typed(storage), *metadata[:3])
        return self._made(reductions.rebuild_tensor(cls.cls, storage, metadata))

    def _rebuild_cuda_tensor(self, *args: Any) -> torch.Tensor:
        """A CUDA tensor from its IPC handle, on the GPU the sender named by index or by UUID. Untrusted,
        its reference counter must be one of torch's files at an offset within it (torch decrements the
        counter there when the tensor is freed), and the tensor must lie within the storage the handle
        names (an empty one, which torch would grow on the GPU, for a missing handle)."""
        from sglang.srt.utils.patch_torch import _rebuild_cuda_tensor_by_uuid

        if len(args) != 15 or args[0] not in (_TENSOR, _PARAMETER) or args[4] not in (_UNTYPED, _TYPED):
            raise UnsafePayloadError(
                "its CUDA tensor is not torch's (tensor class, storage class, arguments)"
            )
        if not self.trusted:
            _check_cuda_tensor(*args)
        tensor = _rebuild_cuda_tensor_by_uuid(args[0].cls, *args[1:4], args[4].cls, *args[5:])
        if not self.trusted and args[7] is not None and args[8]:
            untyped = torch.Tensor.untyped_storage(tensor)
            self.opened[untyped._cdata] = torch.UntypedStorage.nbytes(untyped)
        return self._made(tensor)


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


def _extent(offset: Any, size: Any, stride: Any) -> int:
    """How many elements of its storage a view (offset, size, stride) reaches."""
    ints = (offset, *size, *stride)
    if not all(type(v) is int and v >= 0 for v in ints) or len(size) != len(stride):
        raise UnsafePayloadError("its tensor's offset, size and stride are not non-negative integers")
    return 0 if 0 in size else offset + 1 + sum((n - 1) * s for n, s in zip(size, stride, strict=True))


def _check_extent(storage: torch.storage.TypedStorage, offset: Any, size: Any, stride: Any) -> None:
    """A tensor's elements must lie in its storage: torch grows a storage to fit a larger view, so a
    4-byte storage with size (2**32,) would allocate 16 GiB."""
    if not (isinstance(size, (tuple, torch.Size)) and isinstance(stride, tuple)):
        raise UnsafePayloadError("its tensor's size and stride are not tuples")
    end = _extent(offset, size, stride)
    elements = storage._size()  # (size() warns that TypedStorage is deprecated)
    if end > elements:
        raise UnsafePayloadError(f"its tensor reaches element {end} of a storage of {elements}")


def _check_cuda_tensor(*args: Any) -> None:
    """An untrusted CUDA tensor's reference counter and extent (see `_rebuild_cuda_tensor`)."""
    size, stride, offset, _, dtype, _, handle, nbytes, _, _, counter, counter_offset = args[1:13]
    if not (isinstance(counter, bytes) and _REF_COUNTER_NAME.fullmatch(counter)):
        raise UnsafePayloadError("its CUDA tensor names a reference counter that is not torch's")
    if not (type(counter_offset) is int and 0 <= counter_offset < _REF_COUNTERS):
        raise UnsafePayloadError("its CUDA tensor's reference counter offset is out of range")
    if not (
        isinstance(size, (tuple, torch.Size)) and isinstance(stride, tuple) and isinstance(dtype, torch.dtype)
    ):
        raise UnsafePayloadError("its CUDA tensor's size, stride and dtype are not torch's")
    if not (type(nbytes) is int and nbytes >= 0):
        raise UnsafePayloadError("its CUDA tensor's storage size is not a byte count")
    held = nbytes if handle is not None else 0
    reach = _extent(offset, size, stride) * dtype.itemsize
    if reach > held:
        raise UnsafePayloadError(f"its CUDA tensor reaches byte {reach} of a storage of {held}")


def _no_hooks(hooks: Any) -> bool:
    """torch pickles a tensor's backward hooks as an empty OrderedDict (it never sends hooks)."""
    return hooks is None or (isinstance(hooks, dict) and not hooks)


def _empty_bytes() -> bytes:
    """How protocol 2 writes b"" (`bytes()`); a payload may not make it allocate (`bytes(n)`)."""
    return b""


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
        unpickler = _TensorUnpickler(io.BytesIO(data), trusted, len(data))
        try:
            result = unpickler.load()
            if not trusted:
                unpickler.check_storage_bytes(result)
            return result
        except UnsafePayloadError:
            raise
        except Exception as e:  # noqa: BLE001 - any malformed payload is one error for the client
            raise ValueError(f"it does not unpickle: {type(e).__name__}: {e}") from None
        finally:
            unpickler.release()
