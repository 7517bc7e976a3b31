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
also refuses file descriptors: one can only come from a parent process, and following one means
connecting to an address the payload names.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401 - registers torch's reductions with ForkingPickler


class UnsafePayloadError(ValueError):
    """The payload names something other than tensors and their parts."""


_REDUCTIONS = "torch.multiprocessing.reductions"
_ALLOWED = {
    (_REDUCTIONS, "rebuild_tensor"),
    (_REDUCTIONS, "rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_typed_storage_child"),
    (_REDUCTIONS, "rebuild_storage_filename"),
    (_REDUCTIONS, "rebuild_storage_empty"),
    (_REDUCTIONS, "rebuild_cuda_tensor"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch", "Size"),
    ("torch", "Tensor"),
    ("torch", "device"),
    ("torch.storage", "UntypedStorage"),
    ("torch.nn.parameter", "Parameter"),
    ("collections", "OrderedDict"),  # a plain pickle's (empty) backward hooks
    ("_codecs", "encode"),  # how pickle protocol 2 writes bytes
    ("sglang.srt.utils.patch_torch", "_rebuild_cuda_tensor_by_uuid"),  # after monkey_patch_torch_reductions
    ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),  # the flattened_bucket format
}
_FILE_DESCRIPTORS = {(_REDUCTIONS, "rebuild_storage_fd"), ("multiprocessing.resource_sharer", "DupFd")}


def _load_storage_bytes(data: bytes) -> Any:
    """`torch.storage._load_from_bytes` (a plain pickle's storages) without its unrestricted unpickling."""
    return torch.load(io.BytesIO(data), weights_only=True)


class _TensorUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, trusted: bool):
        super().__init__(file)
        self.trusted = trusted

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage_bytes
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module, name) in _ALLOWED or (self.trusted and (module, name) in _FILE_DESCRIPTORS):
            return super().find_class(module, name)
        if (module, name) in _FILE_DESCRIPTORS:
            raise UnsafePayloadError(
                "the tensors travel as file descriptors, which reach only a process the sender started: send "
                "them by value (pickle.dumps), as CUDA tensors, or under torch's file_system sharing strategy"
            )
        raise UnsafePayloadError(f"it names {module}.{name}, which is not part of a tensor")


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
