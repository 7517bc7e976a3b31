"""`StatePacker`: one request's rows of a server's pools (KV and mamba state) as one contiguous block of
bytes, and back: the packing of the staged PD path (`staging.py`), and the direct path's zeroing of
reserved rows on device pools.

A block holds, for every full-attention layer, K then V of the request's tokens, then for every linear
layer its conv and SSM rows of one slot: the order of `PoolLayout`. A KV buffer's part is head-major:
head 0 of every token (in the order of the slot list), then head 1, ...: so the part of a block a server
of another --tp-size needs (some heads of every position) is one contiguous range per buffer, moved as one
copy (`staged_route.py`), where token-major rows made it one copy per position.

Packing gathers on the device (one `index_select` per buffer, one `cat`) and copies the block to the host
in ONE copy on a copy stream, then waits for that stream once: no host sync per layer. Unpacking copies
each block to the device in one copy and scatters it (one `index_copy_` per KV buffer, one copy per state
part) before the next block's copy, on the copy stream, then waits for it once, however many blocks.
Index tensors go to the device from pinned host memory without a wait. Rows move as bytes (`byte_rows`:
float8 KV too). The same code runs on CPU tensors (no stream)."""

from __future__ import annotations

import math

import torch

from sglang.srt.mem_cache.memory_pool import byte_rows

# The layout of a packed block (`PoolLayout.staged_blocks`): servers that pack otherwise (an older build,
# whose KV was token-major) are refused as a pair rather than exchange scrambled KV.
BLOCK_FORMAT = "kv head-major"


class StatePacker:
    """Packs and unpacks one request's rows of a server's pools (`kv`: K then V of each full-attention
    layer, rows indexed by token slot; `states`: conv of each linear layer, then SSM of each, rows
    indexed by mamba slot)."""

    def __init__(self, kv: list[torch.Tensor], states: list[torch.Tensor], device: torch.device | str):
        self.kv, self.states = kv, states
        self.device = torch.device(device)
        self.kv_row_bytes = [b[0].nbytes for b in kv]
        self.kv_heads = [b.shape[1] if b.dim() == 3 else 1 for b in kv]  # ([rows, heads, head_dim] buffers)
        self.state_bytes = [b[0].nbytes for b in states]
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    @classmethod
    def of(cls, token_to_kv_pool, mamba_pool, device: str) -> StatePacker:
        states = [layer for buf in (mamba_pool.conv_state, mamba_pool.ssm_state) for layer in buf]
        return cls(kv_buffers(token_to_kv_pool), states, device)

    def clear(self, tokens: list[int], slot: int) -> None:
        """Zero the rows of `tokens` and of `slot`: `clear_many` of one destination."""
        self.clear_many([(tokens, slot)])

    def clear_many(self, destinations: list[tuple[list[int], int]]) -> None:
        """Zero the rows of each destination's tokens and slot (device memory: no host address to memset),
        every destination in one op per buffer. Done when this returns (on CUDA: on the copy stream, waited
        for ONCE, whatever the number of destinations), so that the transfers, which the caller asks for
        next and which write straight into these rows, land after the zeros."""
        try:
            with _on(self.stream):
                tokens = [t for dst_tokens, _ in destinations for t in dst_tokens]
                rows = self._index(tokens + [slot for _, slot in destinations])
                idx, slots = rows[: len(tokens)], rows[len(tokens) :]
                for buf in self.kv:
                    byte_rows(buf).index_fill_(0, idx, 0)
                for buf in self.states:
                    byte_rows(buf).index_fill_(0, slots, 0)
        finally:
            self._sync()

    def _sync(self) -> None:
        """Wait for the copy stream (CPU: nothing to wait for). `pack`, `unpack_many`, `clear_many` do so also
        when they raise: what they queued before the error has landed before their caller frees (and
        another request reuses) the rows or the host range."""
        if self.stream is not None:
            self.stream.synchronize()

    def packed_bytes(self, num_tokens: int, state: bool = True) -> int:
        return num_tokens * sum(self.kv_row_bytes) + (sum(self.state_bytes) if state else 0)

    def pack(self, tokens: list[int], slot: int | None, out: torch.Tensor) -> int:
        """Write the rows of `tokens` and of `slot` (None: no state) into the host uint8 tensor `out`;
        returns the bytes written. Blocks until the bytes are on the host (one wait per chunk)."""
        n = self.packed_bytes(len(tokens), slot is not None)
        try:
            with _on(self.stream):
                idx = self._index(tokens)
                parts = [
                    _bytes(_by_head(byte_rows(b).index_select(0, idx), h))
                    for b, h in zip(self.kv, self.kv_heads, strict=True)
                ]
                if slot is not None:
                    parts += [_bytes(b[slot : slot + 1]) for b in self.states]
                out[:n].copy_(torch.cat(parts) if parts else out[:0], non_blocking=self.stream is not None)
        finally:
            self._sync()
        return n

    def unpack(self, src: torch.Tensor, tokens: list[int], slot: int | None) -> None:
        """Scatter a block `pack` wrote (host uint8 tensor) into the rows of `tokens` and `slot` (None: the
        block has no state): `unpack_many` of one block."""
        self.unpack_many([(src, tokens, slot)])

    def unpack_many(self, blocks: list[tuple[torch.Tensor, list[int], int | None]]) -> None:
        """Scatter blocks `pack` wrote (host uint8 tensors, each with its rows: `tokens` and `slot` as in
        `unpack`) into the pools, in order: each block copied to the device in one copy and scattered
        (`_scatter`) before the next block's copy, so that at most one block's device copy is alive (up to
        a staging chunk, however many blocks: memory freed on the copy stream is reused by the next copy
        on it without a wait). On CUDA it waits for the copy stream ONCE, whatever the number of blocks
        (their host ranges are free for the next chunks after it)."""
        if not blocks:
            return
        try:
            with _on(self.stream):
                idx = self._index([t for _, tokens, _ in blocks for t in tokens])
                at = 0
                for src, tokens, slot in blocks:
                    n = self.packed_bytes(len(tokens), slot is not None)
                    block = src[:n].to(self.device, non_blocking=self.stream is not None)
                    self._scatter(block, idx[at : at + len(tokens)], slot)
                    del block  # (before the next block's copy)
                    at += len(tokens)
        finally:
            self._sync()  # (the host ranges are reused by the next transfers once this returns)

    def _scatter(self, block: torch.Tensor, idx: torch.Tensor, slot: int | None) -> None:
        """Write one block on the device into the KV rows `idx` and the state rows of `slot` (None: the
        block has no state)."""
        at = 0
        for buf, row, heads in zip(self.kv, self.kv_row_bytes, self.kv_heads, strict=True):
            size = row * len(idx)
            part = _as(block[at : at + size], buf.dtype).view(heads, len(idx), math.prod(buf.shape[1:]) // heads)
            # (into the pool's head-major view in place: no device copy of the part beside the block's)
            _by_head(byte_rows(buf), heads).index_copy_(1, idx, byte_rows(part))
            at += size
        for buf, size in zip(self.states, self.state_bytes, strict=True):
            if slot is None:
                break
            buf[slot].copy_(_as(block[at : at + size], buf.dtype).view(buf.shape[1:]))
            at += size

    def _index(self, values: list[int]) -> torch.Tensor:
        """`values` as an int64 tensor on the device, queued on the current stream without a host wait:
        built on the host (pinned, on CUDA) and copied non-blocking, where `torch.tensor(values,
        device=cuda)` copies from pageable memory and waits for the copy."""
        host = torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        return host.to(self.device, non_blocking=True)


def kv_buffers(token_to_kv_pool) -> list[torch.Tensor]:
    """A KV pool's buffers in the order both servers move them: K then V of each full-attention layer."""
    return [b for pair in zip(token_to_kv_pool.k_buffer, token_to_kv_pool.v_buffer, strict=True) for b in pair]


def _by_head(rows: torch.Tensor, heads: int) -> torch.Tensor:
    """KV rows [tokens, ...] as [heads, tokens, head elements] (a view). The gather indexes whole rows of
    the pool, and the request's rows alone are reordered (an `index_select` on a head-major view of the
    pool read the whole pool on CPU: 30 ms at 400,000 rows, for a 0.03 ms gather); the scatter writes
    into the pool's head-major view (`index_copy_` takes it in place: 0.09 ms there)."""
    return rows.reshape(rows.shape[0], heads, math.prod(rows.shape[1:]) // heads).transpose(0, 1)


def _as(part: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A packed part's bytes as `dtype`. Parts follow each other unpadded, so one after a part of another
    dtype may start off its element size (a bf16 conv state of odd size, then a float32 SSM state), where
    a view is refused: such a part is copied to a fresh (aligned) tensor first."""
    if part.storage_offset() % dtype.itemsize:
        part = part.clone()
    return part.view(dtype)


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
