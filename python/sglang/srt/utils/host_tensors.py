"""Host tensors built from Python lists, and one-copy moves of many host tensors to a device: what
the scheduler, sampling, the caches and the forward stream use to build a batch's tensors (kept below
`model_executor`, which imports them, so that no lower layer imports the model runtime)."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Sequence

import torch


def host_int64(values: Sequence[int]) -> torch.Tensor:
    """An int64 host tensor of `values`, packed by `struct` into a buffer the tensor then shares: every
    batch makes several, and this is faster than through an `array` (which converts int by int) and
    several times faster than `torch.tensor` on the list (timings: benchmark/README.md)."""
    return _packed(values, "q", torch.int64)


def host_float32(values: Sequence[float]) -> torch.Tensor:
    """A float32 host tensor of `values`, as `host_int64`."""
    return _packed(values, "f", torch.float32)


_PACKERS: dict[tuple[int, str], struct.Struct] = {}  # by (length, code); bounded: see `_packed`
_PACK_FROM = 16  # below this many values `array` is as fast (the struct call has a fixed cost)


def _packed(values: Sequence, code: str, dtype: torch.dtype) -> torch.Tensor:
    n = len(values)
    if n < _PACK_FROM:
        return _sharing(array(code, values), dtype)
    packer = _PACKERS.get((n, code))
    if packer is None:
        if len(_PACKERS) >= 512:  # lengths of extends vary without bound
            _PACKERS.clear()
        packer = _PACKERS[(n, code)] = struct.Struct(f"={n}{code}")
    buf = bytearray(packer.size)
    try:
        packer.pack_into(buf, 0, *values)
    except OverflowError:
        # A float beyond float32's range (a temperature of 1e39 is a valid request, as upstream):
        # `array` rounds it to inf, as torch does, where `struct` refuses it.
        return _sharing(array(code, values), dtype)
    return torch.frombuffer(buf, dtype=dtype)


def host_bool(values: Sequence[bool]) -> torch.Tensor:
    """A bool host tensor of `values`, as `host_int64` (through a `bytearray`)."""
    return _sharing(bytearray(values), torch.bool)


def _sharing(packed: array | bytearray, dtype: torch.dtype) -> torch.Tensor:
    """A tensor sharing `packed`'s memory (`frombuffer` refuses an empty buffer)."""
    return torch.frombuffer(packed, dtype=dtype) if packed else torch.empty(0, dtype=dtype)


_ALIGN = 16  # bytes: every tensor of a packed transfer starts at a multiple (any dtype's alignment)
_PADDING = torch.zeros(_ALIGN, dtype=torch.uint8)


def move_to_device(tensors: Sequence[torch.Tensor | None], device: torch.device) -> list[torch.Tensor | None]:
    """Host tensors on `device` with ONE host-to-device copy: their bytes are packed into one host
    buffer (pinned when CUDA is there, so the copy is non-blocking and the host goes on), copied, and
    each comes back as a view of the device buffer, with its dtype and shape. None stays None. On the
    host device they are returned as they are. Run it on the stream that will read the tensors."""
    if device.type == "cpu":
        return list(tensors)
    pin = device.type == "cuda" and torch.cuda.is_available()
    host, sizes = pack_bytes(tensors, pin)
    dev = torch.empty(host.shape, dtype=torch.uint8, device=device)
    dev.copy_(host, non_blocking=pin)
    return unpack_bytes(dev, tensors, sizes)


def pack_bytes(tensors: Sequence[torch.Tensor | None], pin: bool = False) -> tuple[torch.Tensor, list[int]]:
    """The bytes of `tensors` (host tensors: `torch.cat` does not mix devices) back to back in one uint8
    host buffer, each padded to `_ALIGN`, by one `torch.cat` (one call for the batch's ~20 tensors,
    which takes less host time than a copy per tensor, and so does `move_to_device` as a whole;
    timings: benchmark/README.md), and the pieces' sizes for `unpack_bytes`."""
    parts: list[torch.Tensor] = []
    for t in tensors:
        if t is not None:
            flat = t if t.dim() == 1 else t.reshape(-1)
            if flat.stride(0) != 1:  # a strided view; one of a single element keeps its stride
                flat = flat.contiguous() if flat.numel() > 1 else flat.as_strided(flat.shape, (1,))
            raw = flat.view(torch.uint8)
            parts.append(raw)
            pad = -raw.numel() % _ALIGN
            if pad:
                parts.append(_PADDING[:pad])
    sizes = [p.numel() for p in parts]
    host = torch.empty(max(sum(sizes), _ALIGN), dtype=torch.uint8, pin_memory=pin)
    if parts:
        torch.cat(parts, out=host[: sum(sizes)])
    return host, sizes


def unpack_bytes(
    buffer: torch.Tensor, tensors: Sequence[torch.Tensor | None], sizes: list[int]
) -> list[torch.Tensor | None]:
    """Views of `buffer` (packed by `pack_bytes`, or a copy of it) with `tensors`' dtypes and shapes."""
    pieces = iter(buffer[: sum(sizes)].split(sizes))
    out: list[torch.Tensor | None] = []
    for t in tensors:
        if t is None:
            out.append(None)
            continue
        piece = next(pieces).view(t.dtype)
        out.append(piece if t.dim() == 1 else piece.view(t.shape))
        if -t.numel() * t.element_size() % _ALIGN:
            next(pieces)  # its padding
    return out
