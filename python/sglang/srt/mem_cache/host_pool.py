"""`HostPools`: the host-memory tier of the hierarchical cache (`--enable-hierarchical-cache`): KV pages of
the full-attention layers and recurrent-state snapshots, in CPU tensors laid out as the device pools are,
with their own allocators (host ints, as on the device). The pools are pageable memory, also on CUDA:
only CPU ops (`index_copy_`, `index_select`) touch them; every transfer to or from the device goes
through a pinned staging tensor of that transfer's rows (`to_host`, `load`). Pinning the pools would buy
nothing and cost much: torch's caching host allocator rounds each pinned allocation up to a power of two
(up to 2x the bytes checked below), and pinned memory cannot be swapped. The staging tensors hold only
the rows of the copies in flight (one batch's loads, the backups not landed yet: one or two batches'),
kept by that allocator for reuse. Every row move goes through `byte_rows`: a float8 KV cache
(`--kv-cache-dtype fp8_*`) moves as its bytes (torch has no float8 `index_copy_`).

Sizes: `--hicache-size` GB (when > 0), split between KV and states in the device pools' byte ratio; else
`--hicache-ratio` times the device pools (tokens and slots). Upstream's rule holds: the host tier is at
least as large as the device pools (write-through keeps what the device holds on host too). A host tier
larger than the host memory available (/proc/meminfo's MemAvailable) is refused at start, as upstream
checks it, before any allocation (memory that does not fit fails late or wakes the OOM killer).
Under tensor parallelism each rank holds its own shard's host tier, sized alike on every rank: the sizes
and the memory available are taken as the smallest over the ranks (`smallest`), and the ranks on one
node (`ranks_per_node`) each need their tier from that node's memory, so every rank builds the same
tier or refuses in the same sentence.

The copies (backups: device -> host, loads: host -> device) read and write the pools' tensors: they run
on the forward stream only (`HiCacheController` queues them), never on the scheduler thread.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.memory_pool import MambaPool, MHATokenToKVPool, byte_rows

GB = 1 << 30
UNKNOWN = 1 << 62  # no MemAvailable: no check


class HostPoolSizeError(ValueError):
    """The host tier the flags ask for is smaller than the device pools or larger than the host memory
    available (a startup error)."""


def available_host_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none: the check is skipped)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _bytes(tensors: Sequence[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class HostPools:
    def __init__(
        self,
        kv_pool: MHATokenToKVPool,
        mamba_pool: MambaPool,
        ratio: float,
        size_gb: int,
        smallest: Callable[[int], int] = int,
        ranks_per_node: int = 1,
    ):
        self.kv_pool, self.mamba_pool = kv_pool, mamba_pool
        page = kv_pool.page_size
        dev_tokens, dev_slots = kv_pool.size, mamba_pool.size
        kv_bytes = _bytes([*kv_pool.k_buffer, *kv_pool.v_buffer]) / max(1, dev_tokens)  # per token
        state_bytes = _bytes([mamba_pool.conv_state[:, :1], mamba_pool.ssm_state[:, :1]])  # per slot
        if size_gb > 0:
            budget = size_gb * GB
            dev_total = kv_bytes * dev_tokens + state_bytes * dev_slots
            share = budget / dev_total
            tokens, slots = int(dev_tokens * share), int(dev_slots * share)
            asked = f"--hicache-size {size_gb}"
        else:
            tokens, slots = int(dev_tokens * ratio), int(dev_slots * ratio)
            asked = f"--hicache-ratio {ratio:g}"
        tokens, slots = smallest(tokens), smallest(slots)
        tokens -= tokens % page
        if tokens < dev_tokens or slots < dev_slots:
            raise HostPoolSizeError(
                f"{asked} gives a host tier of {tokens} KV tokens and {slots} state slots, smaller than the "
                f"device pools ({dev_tokens} tokens, {dev_slots} slots): the host tier must hold at least "
                "what the device does; raise it."
            )
        rows = (tokens // page + 1) * page  # page 0 is a dummy, as on the device
        need = int(kv_bytes * rows + state_bytes * (slots + 1))
        avail = available_host_bytes()
        avail = smallest(avail if avail is not None else UNKNOWN)
        ranks = f" x {ranks_per_node} ranks on this node" if ranks_per_node > 1 else ""
        if avail != UNKNOWN and need * ranks_per_node > avail:
            raise HostPoolSizeError(
                f"{asked} gives a host tier of {need / GB:.1f} GB{ranks} but only {avail / GB:.1f} GB of host "
                "memory is available (MemAvailable); lower --hicache-ratio or --hicache-size."
            )
        self.page_size = page
        # Bytes of one token's KV (every layer) and of one state slot, as the disk tier's budget counts them.
        self.token_bytes = _bytes([t[:1] for t in (*kv_pool.k_buffer, *kv_pool.v_buffer)])
        self.slot_bytes = state_bytes
        self.token_allocator = PagedTokenAllocator(tokens, page)
        self.slot_allocator = MambaSlotAllocator(slots)
        def like(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
            shape = list(t.shape)
            shape[dim] = rows
            return torch.zeros(shape, dtype=t.dtype, device="cpu")  # pageable (module docstring)

        self.k_buffer = [like(t, rows, 0) for t in kv_pool.k_buffer]
        self.v_buffer = [like(t, rows, 0) for t in kv_pool.v_buffer]
        self.conv_state = like(mamba_pool.conv_state, slots + 1, 1)
        self.ssm_state = like(mamba_pool.ssm_state, slots + 1, 1)
        self.nbytes = _bytes([*self.k_buffer, *self.v_buffer, self.conv_state, self.ssm_state])

    @property
    def num_tokens(self) -> int:
        return self.token_allocator.size

    @property
    def num_slots(self) -> int:
        return self.slot_allocator.size

    def clear(self) -> None:
        self.token_allocator.clear()
        self.slot_allocator.clear()

    # ---- copies (forward stream only; `HiCacheController` runs them) ---------------------------------
    # One code path for CPU and CUDA: a backup gathers the rows on the device (the current stream), moves
    # them to host (`to_host`: one non-blocking copy per tensor into a pinned staging tensor on CUDA,
    # nothing to move on CPU) and scatters them into the (pageable) host pools once they landed
    # (`scatter`); a load gathers on host (into a pinned staging tensor on CUDA), moves the rows to the
    # device without blocking and scatters them there.

    def _pairs(self, kv: bool) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
        """(device tensor, host tensor, slot dimension): every KV layer's K and V (the MTP draft layer's
        too: one more layer of the pool), or the two state tensors."""
        if kv:
            dev, host = [*self.kv_pool.k_buffer, *self.kv_pool.v_buffer], [*self.k_buffer, *self.v_buffer]
            return [(d, h, 0) for d, h in zip(dev, host, strict=True)]
        mp = self.mamba_pool
        return [(mp.conv_state, self.conv_state, 1), (mp.ssm_state, self.ssm_state, 1)]

    def gather(self, kv: bool, device_slots: torch.Tensor) -> list[torch.Tensor]:
        """Backup, step 1: the rows of `device_slots`, gathered on the device."""
        return [byte_rows(d).index_select(dim, device_slots).view(d.dtype) for d, _, dim in self._pairs(kv)]

    @staticmethod
    def to_host(rows: list[torch.Tensor]) -> list[torch.Tensor]:
        """Backup, step 2: gathered rows into pinned host memory without blocking (CUDA: they have landed
        once an event recorded after this completes); on CPU they are host rows already."""
        if not rows or rows[0].device.type == "cpu":
            return rows
        out = []
        for t in rows:
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            pinned.copy_(t, non_blocking=True)
            out.append(pinned)
        return out

    def scatter(self, kv: bool, host_slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """Backup, step 3 (once the rows landed): into the host pools."""
        for (_, h, dim), r in zip(self._pairs(kv), rows, strict=True):
            byte_rows(h).index_copy_(dim, host_slots, byte_rows(r))

    def load(self, kv: bool, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        """Host rows of `host_slots` into the device rows of `device_slots` (the current stream)."""
        for d, h, dim in self._pairs(kv):
            d, h = byte_rows(d), byte_rows(h)  # (float8 KV as bytes)
            if d.device.type == "cpu":
                rows = h.index_select(dim, host_slots)
            else:
                shape = list(h.shape)
                shape[dim] = len(host_slots)
                pinned = torch.empty(shape, dtype=h.dtype, pin_memory=True)
                torch.index_select(h, dim, host_slots, out=pinned)
                rows = pinned.to(d.device, non_blocking=True)  # (the caching host allocator keeps it)
            d.index_copy_(dim, device_slots, rows)

    def load_kv(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.load(True, host_slots, device_slots)

    def load_states(self, host_slots: torch.Tensor, device_slots: torch.Tensor) -> None:
        self.load(False, host_slots, device_slots)
