"""Memory pools: request rows (`ReqToTokenPool`), K/V of the full-attention layers
(`MHATokenToKVPool`), recurrent state (`MambaPool`), and the hybrid request pools that tie a request
row to its mamba slots (`HybridReqToTokenPool`, and `HybridMambaDecodeReqToTokenPool` for the decode
side of PD disaggregation).

Host/device split: slot and row ids are host ints owned by the scheduler. The tensors here (the
`req_to_token` table, K/V, conv and SSM states) are only read or written on the forward stream; the
scheduler never touches them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.state_copy import StateCopier

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


class ReqToTokenPool:
    """Request rows. `req_to_token[row, i]` is the KV slot of position i of the request in `row`;
    row 0 is padding (padded batch rows point at it)."""

    enable_mamba_extra_buffer_lazy = False

    def __init__(self, size: int, max_context_len: int, device: str = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros(size + 1, max_context_len, dtype=torch.int32, device=device)
        self.free_slots: list[int] = list(range(size, 0, -1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, reqs: Sequence[Req]) -> list[int] | None:
        """A row for every request that has none (others keep theirs); None if rows run out."""
        need = [r for r in reqs if r.req_pool_idx is None]
        if len(need) > len(self.free_slots):
            return None
        for r in need:
            r.req_pool_idx = self.free_slots.pop()
        return [r.req_pool_idx for r in reqs]

    def free(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        self.free_slots.append(req.req_pool_idx)
        req.req_pool_idx = None

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Forward stream only."""
        self.req_to_token[row, start : start + slots.numel()] = slots.to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(self.size, 0, -1))


class MHATokenToKVPool:
    """K and V of the full-attention layers only, `[num_pages + 1) * page_size, heads, head_dim]` per
    layer; page 0 is the dummy page. Global layer ids map to compact indices."""

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_ids: Sequence[int],
        device: str = "cpu",
    ):
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.layer_map = {layer_id: i for i, layer_id in enumerate(layer_ids)}
        rows = (size // page_size + 1) * page_size
        self.k_buffer = [torch.zeros(rows, head_num, head_dim, dtype=dtype, device=device) for _ in layer_ids]
        self.v_buffer = [torch.zeros(rows, head_num, head_dim, dtype=dtype, device=device) for _ in layer_ids]

    def _index(self, layer_id: int) -> int:
        try:
            return self.layer_map[layer_id]
        except KeyError:
            raise ValueError(f"Layer {layer_id} is not a full-attention layer of this KV pool.") from None

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._index(layer_id)
        return self.k_buffer[i], self.v_buffer[i]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        i = self._index(layer_id)
        self.k_buffer[i][loc] = k.to(self.dtype)
        self.v_buffer[i][loc] = v.to(self.dtype)

    def bytes_per_token(self) -> int:
        k = self.k_buffer[0]
        return 2 * len(self.k_buffer) * k.shape[1] * k.shape[2] * k.element_size() if self.k_buffer else 0


class MambaPool:
    """Recurrent state: one tensor per state kind, `[num_linear_layers, size + 1, *shape]`; slot 0 is a
    dummy for padded rows. `mamba_map` maps a global layer id to its index in the stacked tensors.

    `clear_slots`, `copy_from` and `track_copy` move all layers and both state kinds of many slots in one
    launch (`mem_cache/state_copy`: the semantics, -1 skipping, the implementation per device); they must
    run on the forward stream."""

    def __init__(self, size: int, cache_params: Mamba2CacheParams, device: str = "cpu"):
        self.size = size
        self.cache_params = cache_params
        self.device = device
        num_layers = len(cache_params.layers)
        shape, dtype = cache_params.shape, cache_params.dtype
        self.conv_state = torch.zeros(num_layers, size + 1, *shape.conv, dtype=dtype.conv, device=device)
        self.ssm_state = torch.zeros(
            num_layers, size + 1, *shape.temporal, dtype=dtype.temporal, device=device
        )
        self.mamba_map = {layer_id: i for i, layer_id in enumerate(cache_params.layers)}
        self.state_copier = StateCopier([self.conv_state, self.ssm_state])

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) views of one layer: `[size + 1, *shape]`."""
        i = self.mamba_map[layer_id]
        return self.conv_state[i], self.ssm_state[i]

    def clear_slots(self, slots: Sequence[int] | torch.Tensor) -> None:
        self.state_copier.clear(slots)

    def copy_from(self, src: Sequence[int] | torch.Tensor, dst: Sequence[int] | torch.Tensor) -> None:
        self.state_copier.copy(src, dst)

    def track_copy(self, running: torch.Tensor, track: torch.Tensor, mask: torch.Tensor) -> None:
        """Decode track copy: `running[i] -> track[i]` where `mask[i]`, all layers, conv and SSM."""
        self.state_copier.track_copy(running, track, mask)

    def get_contiguous_buf_infos(self) -> list[tuple[int, int, int]]:
        """(data pointer, total bytes, bytes of one slot) per state tensor and layer: one slot of one
        layer is one contiguous block, which is what transfer engines register and move."""
        infos = []
        for buf in (self.conv_state, self.ssm_state):
            for layer in buf:
                infos.append((layer.data_ptr(), layer.nbytes, layer[0].nbytes))
        return infos


class HybridReqToTokenPool(ReqToTokenPool):
    """Request rows plus each request's mamba slots: a running slot, and with an extra-buffer strategy a
    ping-pong track buffer of `mamba_ping_pong_track_buffer_size` entries (2 with overlap, 1 without).
    The request object is authoritative for its slots; `req_index_to_mamba_index` mirrors the running
    slot per row on the host.

    Lazy mode keeps one track slot resident: entry `mamba_next_track_idx` holds it, the other entry is
    -1 until a decode track boundary borrows a second slot."""

    def __init__(
        self,
        size: int,
        mamba_size: int,
        max_context_len: int,
        cache_params: Mamba2CacheParams,
        enable_mamba_extra_buffer: bool,
        enable_mamba_extra_buffer_lazy: bool = False,
        enable_overlap_schedule: bool = True,
        device: str = "cpu",
    ):
        super().__init__(size, max_context_len, device)
        self.mamba_pool = MambaPool(mamba_size, cache_params, device)
        self.mamba_allocator = MambaSlotAllocator(mamba_size)
        self.enable_mamba_extra_buffer = enable_mamba_extra_buffer
        self.enable_mamba_extra_buffer_lazy = enable_mamba_extra_buffer and enable_mamba_extra_buffer_lazy
        self.mamba_ping_pong_track_buffer_size = 2 if enable_overlap_schedule else 1
        self.req_index_to_mamba_index: list[int] = [0] * (size + 1)

    # ---- rows and running slots --------------------------------------------------------------------

    def alloc(self, reqs: Sequence[Req]) -> list[int] | None:
        """Rows, running slots (fresh ones are flagged `mamba_needs_clear`; the clear itself runs on the
        forward stream) and track buffers. All or nothing: on failure nothing is held and None is
        returned."""
        new_rows = [r for r in reqs if r.req_pool_idx is None]
        need_running = [r for r in reqs if r.mamba_pool_idx is None]
        need_track = [
            r for r in reqs if self.enable_mamba_extra_buffer and r.mamba_ping_pong_track_buffer is None
        ]
        per_track = 1 if self.enable_mamba_extra_buffer_lazy else self.mamba_ping_pong_track_buffer_size
        n_slots = len(need_running) + per_track * len(need_track)
        if len(new_rows) > len(self.free_slots):
            return None
        slots = self.mamba_allocator.alloc(n_slots)
        if slots is None:
            return None
        rows = super().alloc(reqs)
        assert rows is not None
        it = iter(slots)
        for r in need_running:
            r.mamba_pool_idx = next(it)
            r.mamba_needs_clear = True
        for r in need_track:
            self._set_track_buffer(r, [next(it) for _ in range(per_track)])
        for r in reqs:
            self.req_index_to_mamba_index[r.req_pool_idx] = r.mamba_pool_idx
        return rows

    def _set_track_buffer(self, req: Req, slots: list[int]) -> None:
        buf = slots + [-1] * (self.mamba_ping_pong_track_buffer_size - len(slots))
        req.mamba_ping_pong_track_buffer = buf
        req.mamba_next_track_idx = 0

    def _alloc_ping_pong_buffer(self, req: Req) -> bool:
        """Give `req` its track buffer: all entries, or one in lazy mode (the other stays -1)."""
        n = 1 if self.enable_mamba_extra_buffer_lazy else self.mamba_ping_pong_track_buffer_size
        slots = self.mamba_allocator.alloc(n)
        if slots is None:
            return False
        self._set_track_buffer(req, slots)
        return True

    def free(self, req: Req) -> None:
        if req.req_pool_idx is not None:
            self.req_index_to_mamba_index[req.req_pool_idx] = 0
        super().free(req)

    def free_mamba_cache(self, req: Req, mamba_ping_pong_track_buffer_to_keep: int | None = None) -> None:
        """Free the running slot and the track slots except entry `..._to_keep` (now owned by the tree);
        -1 entries are skipped. The request's mamba fields are cleared."""
        out = []
        if req.mamba_pool_idx is not None:
            out.append(req.mamba_pool_idx)
        buf = req.mamba_ping_pong_track_buffer
        if buf is not None:
            out += [s for i, s in enumerate(buf) if s != -1 and i != mamba_ping_pong_track_buffer_to_keep]
        out += [slot for slot, _ in req.mamba_extra_snapshots]
        self.mamba_allocator.free(out)
        req.mamba_extra_snapshots = []
        req.mamba_pool_idx = None
        req.mamba_ping_pong_track_buffer = None
        req.mamba_next_track_idx = 0
        req.mamba_needs_clear = False
        if req.req_pool_idx is not None:
            self.req_index_to_mamba_index[req.req_pool_idx] = 0

    # ---- ping-pong track buffer -------------------------------------------------------------------

    def get_mamba_ping_pong_other_idx(self, idx: int) -> int:
        return 1 - idx if self.mamba_ping_pong_track_buffer_size == 2 else idx

    def get_mamba_ping_pong_keep_idx(self, req: Req) -> int:
        """The entry that holds the newest snapshot. Normal mode swaps `mamba_next_track_idx` as soon as
        a snapshot is scheduled, so that is the other entry; lazy mode writes into the entry
        `mamba_next_track_idx` points at."""
        if self.enable_mamba_extra_buffer_lazy:
            return req.mamba_next_track_idx
        return self.get_mamba_ping_pong_other_idx(req.mamba_next_track_idx)

    def set_mamba_ping_pong_slot(self, req: Req, idx: int, slot: int) -> None:
        req.mamba_ping_pong_track_buffer[idx] = slot

    def donate_mamba_ping_pong_slot(self, req: Req, idx: int) -> None:
        """Return entry `idx`'s slot to the pool and mark the entry -1 (lazy: back to one slot)."""
        slot = req.mamba_ping_pong_track_buffer[idx]
        assert slot != -1, "donating an empty track entry"
        self.mamba_allocator.free([slot])
        req.mamba_ping_pong_track_buffer[idx] = -1

    def exchange_mamba_ping_pong_slot(self, req: Req, idx: int, new_slot: int) -> int:
        """Hand entry `idx`'s snapshot slot over (to the tree) and put `new_slot` in its place."""
        old = req.mamba_ping_pong_track_buffer[idx]
        assert old != -1, "handing over an empty track entry"
        req.mamba_ping_pong_track_buffer[idx] = new_slot
        return old

    # ---- accounting -------------------------------------------------------------------------------

    @staticmethod
    def mamba_slots_of(req: Req) -> list[int]:
        """Every mamba slot `req` holds: running slot, track slots, borrowed snapshot slots, and a COW
        destination is the running slot itself."""
        out = [] if req.mamba_pool_idx is None else [req.mamba_pool_idx]
        out += [s for s in (req.mamba_ping_pong_track_buffer or ()) if s != -1]
        out += [slot for slot, _ in req.mamba_extra_snapshots]
        return out

    def resident_slots_per_req(self) -> int:
        """Slots a running request holds between track boundaries."""
        if not self.enable_mamba_extra_buffer:
            return 1
        if self.enable_mamba_extra_buffer_lazy:
            return 2
        return 1 + self.mamba_ping_pong_track_buffer_size

    def clear(self) -> None:
        super().clear()
        self.mamba_allocator.clear()
        self.req_index_to_mamba_index = [0] * (self.size + 1)


class HybridMambaDecodeReqToTokenPool(HybridReqToTokenPool):
    """The decode side of PD disaggregation pre-allocates destinations (request row and running slot)
    for transfers in flight beyond the running cap: `pre_alloc_size` extra rows. Its mamba pool is sized
    to what those rows can hold, raised above a smaller `--max-mamba-cache-size` with a warning."""

    def __init__(
        self,
        size: int,
        pre_alloc_size: int,
        max_mamba_cache_size: int | None,
        max_context_len: int,
        cache_params: Mamba2CacheParams,
        enable_mamba_extra_buffer: bool,
        enable_overlap_schedule: bool = True,
        device: str = "cpu",
    ):
        ping_pong = 2 if enable_overlap_schedule else 1
        self.pre_alloc_size = pre_alloc_size
        self.slots_per_req = 1 + (ping_pong if enable_mamba_extra_buffer else 0)
        self.max_slots_needed = (size + pre_alloc_size) * self.slots_per_req
        if max_mamba_cache_size is None:
            mamba_size = self.max_slots_needed
        else:
            mamba_size = max(max_mamba_cache_size, self.max_slots_needed)
            if mamba_size > max_mamba_cache_size:
                logger.warning(
                    "The decode server raises --max-mamba-cache-size from %d to %d: %d request rows "
                    "(%d running + %d pre-allocated) need %d slot(s) each.",
                    max_mamba_cache_size, mamba_size, size + pre_alloc_size, size, pre_alloc_size,
                    self.slots_per_req,
                )  # fmt: skip
        self.mamba_spec_state_size = size + pre_alloc_size
        super().__init__(
            size + pre_alloc_size,
            mamba_size,
            max_context_len,
            cache_params,
            enable_mamba_extra_buffer=enable_mamba_extra_buffer,
            enable_mamba_extra_buffer_lazy=False,
            enable_overlap_schedule=enable_overlap_schedule,
            device=device,
        )
