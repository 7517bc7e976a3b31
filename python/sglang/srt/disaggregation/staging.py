"""Staging one request's KV and state through host memory, for pools a transfer engine cannot address.

Mooncake's `-non-cuda` build moves host memory only. With CUDA pools and such a build, a transfer goes
prefill GPU -> pinned host staging buffer -> (transfer engine) -> decode host staging buffer -> decode
GPU. A request is packed into one contiguous block: for every full-attention layer K then V of its
tokens (token-major, in the order of the slot list), then for every linear layer its conv and SSM rows
of one slot, the order of `PoolLayout`. Packing gathers on the device (one `index_select` per buffer,
one `cat`) and copies the block to the host in ONE copy on a copy stream, then waits for that stream
once: no host sync per layer. Unpacking copies the block to the device in one copy and scatters it
(`index_copy_` per buffer) on the copy stream; the forward stream waits for its event before reading.

The same code runs on CPU tensors (no streams, nothing pinned): that is how the packing is tested, and
what `SGLANG_DISAGGREGATION_STAGING=1` runs on CPU pools to exercise the staged protocol end to end.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass

import torch

from sglang.srt.environ import envs

logger = logging.getLogger(__name__)


class StatePacker:
    """Packs and unpacks one request's rows of a server's pools (`kv`: K then V of each full-attention
    layer, rows indexed by token slot; `states`: conv of each linear layer, then SSM of each, rows
    indexed by mamba slot)."""

    def __init__(self, kv: list[torch.Tensor], states: list[torch.Tensor], device: torch.device | str):
        self.kv, self.states = kv, states
        self.device = torch.device(device)
        self.kv_row_bytes = [b[0].nbytes for b in kv]
        self.state_bytes = [b[0].nbytes for b in states]
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @classmethod
    def of(cls, token_to_kv_pool, mamba_pool, device: str) -> StatePacker:
        kv = [
            b for pair in zip(token_to_kv_pool.k_buffer, token_to_kv_pool.v_buffer, strict=True) for b in pair
        ]
        states = [layer for buf in (mamba_pool.conv_state, mamba_pool.ssm_state) for layer in buf]
        return cls(kv, states, device)

    def clear(self, tokens: list[int], slot: int) -> None:
        """Zero the rows of `tokens` and of `slot` (device memory: no host address to memset)."""
        idx = torch.tensor(tokens, dtype=torch.int64, device=self.device)
        for buf in self.kv:
            buf.index_fill_(0, idx, 0)
        for buf in self.states:
            buf[slot].zero_()

    def packed_bytes(self, num_tokens: int) -> int:
        return num_tokens * sum(self.kv_row_bytes) + sum(self.state_bytes)

    def pack(self, tokens: list[int], slot: int, out: torch.Tensor) -> int:
        """Write the rows of `tokens` and of `slot` into the host uint8 tensor `out`; returns the bytes
        written. Blocks until the bytes are on the host (one wait per request)."""
        n = self.packed_bytes(len(tokens))
        with _on(self.stream):
            idx = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            parts = [_bytes(b.index_select(0, idx)) for b in self.kv]
            parts += [_bytes(b[slot : slot + 1]) for b in self.states]
            out[:n].copy_(torch.cat(parts) if parts else out[:0], non_blocking=self.stream is not None)
        if self.stream is not None:
            self.stream.synchronize()
        return n

    def unpack(self, src: torch.Tensor, tokens: list[int], slot: int) -> None:
        """Scatter a block `pack` wrote (host uint8 tensor) into the rows of `tokens` and `slot`. On CUDA
        it waits for the copy stream once (the host range is free for the next transfer after it)."""
        n = self.packed_bytes(len(tokens))
        with _on(self.stream):
            block = src[:n].to(self.device, non_blocking=self.stream is not None)
            idx = torch.tensor(tokens, dtype=torch.int64, device=self.device)
            at = 0
            for buf, row in zip(self.kv, self.kv_row_bytes, strict=True):
                size = row * len(tokens)
                rows = block[at : at + size].view(buf.dtype).view(len(tokens), *buf.shape[1:])
                buf.index_copy_(0, idx, rows)
                at += size
            for buf, size in zip(self.states, self.state_bytes, strict=True):
                buf[slot].copy_(block[at : at + size].view(buf.dtype).view(buf.shape[1:]))
                at += size
        if self.stream is not None:
            # The host range is reused by the next transfer once this returns: the copy must be done.
            self.stream.synchronize()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(-1)


class _on:
    """`torch.cuda.stream(s)`, or nothing for CPU tensors."""

    def __init__(self, stream):
        self.ctx = torch.cuda.stream(stream) if stream is not None else None

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *exc):
        if self.ctx is not None:
            self.ctx.__exit__(*exc)


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """A host byte buffer a transfer engine can register (pinned when the pools are on CUDA, so that the
    copies to and from the device are asynchronous)."""
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin)


class ByteRanges:
    """First-fit ranges of a staging buffer, one per request in flight (the decode side reserves one
    with each destination; a request waits for room as it waits for KV slots)."""

    def __init__(self, size: int):
        self.size = size
        self.used: dict[int, int] = {}  # start -> length

    def alloc(self, n: int) -> int | None:
        n = max(n, 1)  # (two empty ranges must not share a start)
        at = 0
        for start in sorted(self.used):
            if start - at >= n:
                break  # the gap before this range fits
            at = start + self.used[start]
        else:
            if self.size - at < n:
                return None
        self.used[at] = n
        return at

    def free(self, start: int) -> None:
        del self.used[start]


def mooncake_moves_gpu_memory() -> bool:
    """Whether the installed Mooncake is its CUDA build (`mooncake-transfer-engine`), which registers
    and moves device memory; the `-non-cuda` build moves host memory only."""
    try:
        importlib.metadata.version("mooncake-transfer-engine")
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def transfer_path(device: str) -> str:
    """How this server's pools are transferred: "host" (CPU pools, registered as they are), "gpu" (CUDA
    pools registered directly: the engine's CUDA build) or "staged" (through host staging buffers: CUDA
    pools with a host-only engine, or SGLANG_DISAGGREGATION_STAGING=1)."""
    if envs.SGLANG_DISAGGREGATION_STAGING.get():
        return "staged"
    if device == "cpu":
        return "host"
    return "gpu" if mooncake_moves_gpu_memory() else "staged"


@dataclass
class Staging:
    """A server's staging buffer (registered with the transfer engine instead of its pools) and the
    packing of its pools' rows."""

    packer: StatePacker
    buffer: torch.Tensor
    ranges: ByteRanges

    @classmethod
    def create(cls, packer: StatePacker, nbytes: int) -> Staging:
        return cls(packer, host_buffer(nbytes, pin=packer.device.type == "cuda"), ByteRanges(nbytes))

    def address(self, start: int) -> int:
        return self.buffer.data_ptr() + start
