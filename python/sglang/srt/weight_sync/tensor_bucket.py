"""`FlattenedTensorBucket`, at upstream's import path: many tensors sent as one byte tensor and a list
of `FlattenedTensorMetadata`, the `flattened_bucket` load format of /update_weights_from_tensor (one
handle to share instead of one per tensor). A trainer builds it:

    bucket = FlattenedTensorBucket(named_tensors=named_tensors)
    payload = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    serialized = MultiprocessingSerializer.serialize(payload, output_str=True)

and the server takes the tensors back as views of the byte tensor (`reconstruct_tensors`; `from_payload`
checks a payload that came from outside first)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class FlattenedTensorMetadata:
    """One tensor of a bucket: its bytes are [start_idx, end_idx) of the flattened tensor."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __setstate__(self, state: Any) -> None:
        """Pickle's BUILD: this entry's fields, nothing else. (A payload may BUILD whatever it names,
        this class included, which would set the server's own class attributes.)"""
        if not (isinstance(state, dict) and state.keys() == _FIELDS):
            raise ValueError("a FlattenedTensorMetadata's state is its fields")
        self.__dict__.update(state)


_FIELDS = {"name", "shape", "dtype", "start_idx", "end_idx", "numel"}


class FlattenedTensorBucket:
    supports_multi_dtypes = True  # (upstream's marker: tensors of several dtypes share a bucket)

    def __init__(
        self,
        named_tensors: list[tuple[str, torch.Tensor]] | None = None,
        flattened_tensor: torch.Tensor | None = None,
        metadata: list[FlattenedTensorMetadata] | None = None,
    ):
        """From `named_tensors` (flattened here, on their device), or from a flattened tensor and its
        metadata (a received bucket)."""
        if named_tensors is not None:
            if not named_tensors:
                raise ValueError("A tensor bucket needs at least one tensor.")
            pieces, self.metadata, start = [], [], 0
            for name, tensor in named_tensors:
                data = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
                end = start + data.numel()
                meta = FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, start, end, tensor.numel())
                self.metadata.append(meta)
                pieces.append(data)
                start += data.numel()
            self.flattened_tensor = torch.cat(pieces)
        elif flattened_tensor is not None and metadata is not None:
            self.flattened_tensor, self.metadata = flattened_tensor, list(metadata)
        else:
            raise ValueError("Give named_tensors, or flattened_tensor with its metadata.")

    def get_flattened_tensor(self) -> torch.Tensor:
        return self.flattened_tensor

    def get_metadata(self) -> list[FlattenedTensorMetadata]:
        return self.metadata

    def reconstruct_tensors(self) -> list[tuple[str, torch.Tensor]]:
        """The (name, tensor) pairs, each a view of the flattened tensor's bytes (a copy of those bytes
        where they do not start at a multiple of the dtype's size, which a view cannot reinterpret)."""
        out = []
        for m in self.metadata:
            data = self.flattened_tensor[m.start_idx : m.end_idx]
            if m.start_idx % m.dtype.itemsize:
                data = data.clone()
            out.append((m.name, data.view(m.dtype).reshape(m.shape)))
        return out

    @classmethod
    def from_payload(cls, payload: Any) -> FlattenedTensorBucket:
        """The bucket of a received `{"flattened_tensor", "metadata"}`; ValueError, in one sentence, where
        the payload is not one, an entry does not lie within the bytes it names, or two entries overlap
        (a bucket's tensors are disjoint: overlapping entries, each unaligned and so copied by
        `reconstruct_tensors`, would copy the bytes once per entry)."""
        if not isinstance(payload, dict) or set(payload) != {"flattened_tensor", "metadata"}:
            raise ValueError('a flattened_bucket payload is {"flattened_tensor": ..., "metadata": [...]}')
        flat, metadata = payload["flattened_tensor"], payload["metadata"]
        if not (isinstance(flat, torch.Tensor) and flat.dtype == torch.uint8 and flat.dim() == 1):
            raise ValueError("its flattened_tensor must be a 1-D uint8 tensor")
        if not isinstance(metadata, list):
            raise ValueError("its metadata must be a list of FlattenedTensorMetadata")
        for i, m in enumerate(metadata):
            if not _well_formed(m):
                raise ValueError(f"its metadata entry {i} is not a FlattenedTensorMetadata")
            size = torch.Size(m.shape).numel()
            inside = 0 <= m.start_idx <= m.end_idx <= flat.numel()
            if m.numel != size or not inside or m.end_idx - m.start_idx != size * m.dtype.itemsize:
                raise ValueError(
                    f"its metadata for {m.name} ({m.dtype}, shape {tuple(m.shape)}) does not match bytes "
                    f"[{m.start_idx}, {m.end_idx}) of a {flat.numel()}-byte tensor"
                )
        spans = sorted((m.start_idx, m.end_idx, m.name) for m in metadata if m.end_idx > m.start_idx)
        for (_, end, name), (start, _, other) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise ValueError(
                    f"its metadata entries for {name} and {other} overlap (a bucket's are disjoint)"
                )
        return cls(flattened_tensor=flat, metadata=metadata)


def _well_formed(m: Any) -> bool:
    if not isinstance(m, FlattenedTensorMetadata):
        return False
    if not (isinstance(m.name, str) and isinstance(m.dtype, torch.dtype)):
        return False
    if not (isinstance(m.shape, (torch.Size, tuple, list)) and all(_is_int(d) and d >= 0 for d in m.shape)):
        return False
    return all(_is_int(v) for v in (m.start_idx, m.end_idx, m.numel))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
