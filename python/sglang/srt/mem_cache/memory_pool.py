"""Memory pools: request rows (`ReqToTokenPool`), K/V of the full-attention layers
(`MHATokenToKVPool`), recurrent state (`MambaPool`), and the hybrid request pool that ties a request
row to its mamba slots (`HybridReqToTokenPool`; the PD decode side's is in `disaggregation/decode.py`).

Host/device split: slot and row ids are host ints owned by the scheduler. The tensors here (the
`req_to_token` table, K/V, conv and SSM states) are only read or written on the forward stream; the
scheduler never touches them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sglang.srt.configs.mamba_utils import Mamba2CacheParams
from sglang.srt.environ import envs
from sglang.srt.layers.gpu_ops import triton_chosen
from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
from sglang.srt.mem_cache.mamba_strategy import MambaStrategy
from sglang.srt.mem_cache.state_copy import StateCopier

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


def byte_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as every indexing op takes it: a one-byte dtype (float8 KV, `--kv-cache-dtype`) as its bytes
    (uint8, same shape), any other as it is. Torch has no float8 `index_copy_` / `index_fill_` (CPU or
    CUDA), nor float8 `index_select` on every CUDA build; moving rows as bytes is exact. Every row move of
    a pool buffer (writes, host tier, PD staging) goes through this."""
    return t.view(torch.uint8) if t.dtype.itemsize == 1 else t


FLOAT8_MAX = {t: torch.finfo(t).max for t in (torch.float8_e4m3fn, torch.float8_e5m2)}  # 448, 57,344

class ReqToTokenPool:
    """Request rows. `req_to_token[row, i]` is the KV slot of position i of the request in `row`;
    row 0 is padding (padded batch rows point at it).

    `slot_epoch` changes whenever some request's row or running slot does (every write to those fields
    goes through this class): what a decode batch keeps from step to step is valid while it stays."""

    def __init__(self, size: int, max_context_len: int, device: str = "cpu"):
        self.size = size
        self.max_context_len = max_context_len
        self.device = device
        self.req_to_token = torch.zeros(size + 1, max_context_len, dtype=torch.int32, device=device)
        self.free_slots: list[int] = list(range(size, 0, -1))
        self.slot_epoch = 0

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, reqs: Sequence[Req]) -> list[int] | None:
        """A row for every request that has none (others keep theirs); None if rows run out."""
        need = [r for r in reqs if r.req_pool_idx is None]
        if len(need) > len(self.free_slots):
            return None
        for r in need:
            r.req_pool_idx = self.free_slots.pop()
        self.slot_epoch += 1
        return [r.req_pool_idx for r in reqs]

    def free(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        self.free_slots.append(req.req_pool_idx)
        req.req_pool_idx = None
        self.slot_epoch += 1

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        """Forward stream only."""
        self.req_to_token[row, start : start + slots.numel()] = slots.to(torch.int32)

    def clear(self) -> None:
        self.free_slots = list(range(self.size, 0, -1))
        self.slot_epoch += 1


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
        # K and V rows in one Triton launch (CUDA; a float8 pool keeps torch's conversion and clamp): the
        # kernel's function where chosen (imported here: a CPU install may lack triton), else None.
        self.store_kv = None
        if dtype not in FLOAT8_MAX and triton_chosen(
            envs.SGLANG_GPU_ELEMENTWISE_BACKEND, torch.device(device), "sglang.srt.layers.attention.triton_ops.store_kv"
        ):
            from sglang.srt.layers.attention.triton_ops.store_kv import store_kv

            self.store_kv = store_kv

    def _index(self, layer_id: int) -> int:
        try:
            return self.layer_map[layer_id]
        except KeyError:
            raise ValueError(f"Layer {layer_id} is not a full-attention layer of this KV pool.") from None

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        i = self._index(layer_id)
        return self.k_buffer[i], self.v_buffer[i]

    def set_kv_buffer(
        self,
        layer_id: int,
        loc: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        """Stores `k / k_scale` and `v / v_scale` at `loc`, converted to the pool's dtype
        (`--kv-cache-dtype`; the scales are the layer's `kv_scales`, `layers/attention/kv_scales.py`).
        A float8 pool saturates at its largest value (e4m3fn +-448, e5m2 +-57,344): clamped here, because
        torch's conversions do not saturate everywhere (e4m3fn on CUDA makes NaN of a value past the range,
        e5m2 makes inf on any device), and a NaN or inf key poisons every later token's attention."""
        i = self._index(layer_id)
        if (
            self.store_kv is not None and k_scale == v_scale == 1.0 and k.dtype == v.dtype == self.dtype
            and k.stride(-1) == v.stride(-1) == 1 and loc.dim() == 1 and loc.numel() == k.shape[0]
        ):  # fmt: skip
            self.store_kv(self.k_buffer[i], self.v_buffer[i], loc, k, v)
            return
        if k_scale != 1.0:
            k = k.float() / k_scale
        if v_scale != 1.0:
            v = v.float() / v_scale
        if self.dtype in FLOAT8_MAX:
            top = FLOAT8_MAX[self.dtype]
            k, v = k.clamp(-top, top), v.clamp(-top, top)
        for buf, new in ((self.k_buffer[i], k.to(self.dtype)), (self.v_buffer[i], v.to(self.dtype))):
            byte_rows(buf)[loc] = byte_rows(new)  # (float8 as bytes, as upstream does)

    def bytes_per_token(self) -> int:
        k = self.k_buffer[0]
        return 2 * len(self.k_buffer) * k.shape[1] * k.shape[2] * k.element_size() if self.k_buffer else 0


class MambaPool:
    """Recurrent state: one tensor per state kind, `[num_linear_layers, size + 1, *shape]`; slot 0 is a
    dummy for padded rows. `mamba_map` maps a global layer id to its index in the stacked tensors.

    `clear_slots`, `copy_from` and `track_copy` move all layers and both state kinds of many slots in one
    launch (`mem_cache/state_copy`: the semantics, -1 skipping, the implementation per device); they must
    run on the forward stream.

    Speculative decoding adds verify rows past the slots, `verify_shape = (batch rows, tokens per row)`:
    a verify forward leaves the state after position t of batch row b in `verify_row(b, t)`, and the
    scheduler copies the accepted one into the running slot (`speculative/ngram_worker.py`). No allocator
    hands them out."""

    def __init__(
        self,
        size: int,
        cache_params: Mamba2CacheParams,
        device: str = "cpu",
        verify_shape: tuple[int, int] = (0, 0),
    ):
        self.size = size
        self.cache_params = cache_params
        self.device = device
        self.verify_shape = verify_shape
        rows = size + 1 + verify_shape[0] * verify_shape[1]
        num_layers = len(cache_params.layers)
        shape, dtype = cache_params.shape, cache_params.dtype
        self.conv_state = torch.zeros(num_layers, rows, *shape.conv, dtype=dtype.conv, device=device)
        self.ssm_state = torch.zeros(num_layers, rows, *shape.temporal, dtype=dtype.temporal, device=device)
        self.mamba_map = {layer_id: i for i, layer_id in enumerate(cache_params.layers)}
        self.state_copier = StateCopier([self.conv_state, self.ssm_state])

    def layer_cache(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv, ssm) views of one layer: `[size + 1, *shape]`."""
        i = self.mamba_map[layer_id]
        return self.conv_state[i], self.ssm_state[i]

    def verify_row(self, row: int, step: int) -> int:
        """Where a verify forward leaves batch row `row`'s state after its token `step`."""
        rows, width = self.verify_shape
        assert 0 <= row < rows and 0 <= step < width, f"no verify row ({row}, {step}) in {self.verify_shape}"
        return self.size + 1 + row * width + step

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
    """Request rows plus each request's mamba slots: a running slot, with `extra_buffer` a ping-pong
    track buffer of `strategy.track_entries` entries, and snapshot slots borrowed until the tree takes
    them (`mamba_extra_snapshots`: every snapshot under `extra_buffer_lazy`, which keeps no track
    buffer). The request object is authoritative for its slots, and every write to its slot fields
    goes through a method here: one owner."""

    def __init__(
        self,
        size: int,
        mamba_size: int,
        max_context_len: int,
        cache_params: Mamba2CacheParams,
        strategy: MambaStrategy,
        device: str = "cpu",
        verify_shape: tuple[int, int] = (0, 0),
    ):
        super().__init__(size, max_context_len, device)
        self.mamba_pool = MambaPool(mamba_size, cache_params, device, verify_shape)
        self.mamba_allocator = MambaSlotAllocator(mamba_size)
        self.strategy = strategy

    # ---- rows and running slots --------------------------------------------------------------------

    def mamba_slots_needed(self, req: Req) -> int:
        """Slots `req` still needs to run: its running slot and its resident track slots."""
        return self.strategy.slots_to_admit(
            req.mamba_pool_idx is not None, req.mamba_ping_pong_track_buffer is not None
        )

    def alloc(self, reqs: Sequence[Req]) -> list[int] | None:
        """Rows, running slots (fresh ones are flagged `mamba_needs_clear`; the clear itself runs on the
        forward stream) and track buffers. All or nothing: on failure nothing is held and None is
        returned."""
        new_rows = [r for r in reqs if r.req_pool_idx is None]
        if len(new_rows) > len(self.free_slots):
            return None
        slots = self.mamba_allocator.alloc(sum(self.mamba_slots_needed(r) for r in reqs))
        if slots is None:
            return None
        rows = super().alloc(reqs)
        assert rows is not None
        it = iter(slots)
        for r in reqs:
            if r.mamba_pool_idx is None:
                self.set_running_slot(r, next(it), needs_clear=True)
            if self.strategy.track_entries and r.mamba_ping_pong_track_buffer is None:
                r.mamba_ping_pong_track_buffer = [next(it) for _ in range(self.strategy.track_entries)]
                r.mamba_next_track_idx = 0
        return rows

    def set_running_slot(self, req: Req, slot: int, needs_clear: bool) -> None:
        """`req` runs in `slot`: a fresh one is zeroed on the forward stream (`needs_clear`), a COW
        destination gets the checkpoint copied in instead."""
        assert req.mamba_pool_idx is None, f"{req} already has a running slot"
        req.mamba_pool_idx = slot
        req.mamba_needs_clear = needs_clear
        self.slot_epoch += 1

    def free_running_slot(self, req: Req) -> None:
        if req.mamba_pool_idx is not None:
            self.mamba_allocator.free([req.mamba_pool_idx])
            req.mamba_pool_idx = None
            self.slot_epoch += 1
        req.mamba_needs_clear = False

    def donate_running_slot(self, req: Req) -> int:
        """A finished request's running slot becomes a checkpoint; the tree owns it now."""
        slot, req.mamba_pool_idx = req.mamba_pool_idx, None
        assert slot is not None
        self.slot_epoch += 1
        return slot

    def free_mamba_cache(self, req: Req, mamba_ping_pong_track_buffer_to_keep: int | None = None) -> None:
        """Free the running slot, borrowed snapshot slots and the track slots except entry
        `..._to_keep` (now owned by the tree). The request's mamba fields are cleared."""
        out = [] if req.mamba_pool_idx is None else [req.mamba_pool_idx]
        buf = req.mamba_ping_pong_track_buffer
        if buf is not None:
            out += [s for i, s in enumerate(buf) if i != mamba_ping_pong_track_buffer_to_keep]
        out += [slot for slot, _ in self.take_extra_snapshots(req)]
        self.mamba_allocator.free(out)
        req.mamba_pool_idx = None
        self.slot_epoch += 1
        req.mamba_ping_pong_track_buffer = None
        req.mamba_next_track_idx = 0
        req.mamba_needs_clear = False

    # ---- snapshot slots ---------------------------------------------------------------------------

    def add_extra_snapshot(self, req: Req, slot: int, position: int) -> None:
        """A slot borrowed for a snapshot (a prefill one beyond the primary, or any under lazy), held
        until the tree takes it."""
        req.mamba_extra_snapshots.append((slot, position))

    def pop_extra_snapshot(self, req: Req, position: int) -> int | None:
        """Hand over the borrowed snapshot at `position` (the caller owns its slot now); None if `req`
        holds none there (it was released since the snapshot was scheduled)."""
        for i, (slot, pos) in enumerate(req.mamba_extra_snapshots):
            if pos == position:
                del req.mamba_extra_snapshots[i]
                return slot
        return None

    def extra_snapshot_at(self, req: Req, position: int) -> int | None:
        """The slot `req` borrowed for a snapshot at `position` and still holds, if any."""
        return next((slot for slot, pos in req.mamba_extra_snapshots if pos == position), None)

    def take_extra_snapshots(self, req: Req) -> list[tuple[int, int]]:
        """Hand over the borrowed snapshots, (slot, position); the caller owns their slots now."""
        out, req.mamba_extra_snapshots = req.mamba_extra_snapshots, []
        return out

    # ---- ping-pong track buffer -------------------------------------------------------------------

    def get_mamba_ping_pong_other_idx(self, idx: int) -> int:
        return self.strategy.other_entry(idx)

    def get_mamba_ping_pong_keep_idx(self, req: Req) -> int:
        return self.strategy.keep_entry(req.mamba_next_track_idx)

    def advance_track_entry(self, req: Req, written: int) -> None:
        """A snapshot into entry `written` was scheduled: the next one goes into the other entry."""
        req.mamba_next_track_idx = self.strategy.other_entry(written)

    def exchange_mamba_ping_pong_slot(self, req: Req, idx: int, new_slot: int) -> int:
        """Hand entry `idx`'s snapshot slot over (to the tree) and put `new_slot` in its place."""
        old = req.mamba_ping_pong_track_buffer[idx]
        req.mamba_ping_pong_track_buffer[idx] = new_slot
        return old

    # ---- accounting -------------------------------------------------------------------------------

    @staticmethod
    def mamba_slots_of(req: Req) -> list[int]:
        """Every mamba slot `req` holds: running slot, track slots, borrowed snapshot slots, and a COW
        destination is the running slot itself."""
        out = [] if req.mamba_pool_idx is None else [req.mamba_pool_idx]
        out += req.mamba_ping_pong_track_buffer or ()
        out += [slot for slot, _ in req.mamba_extra_snapshots]
        return out

    def clear(self) -> None:
        super().clear()
        self.mamba_allocator.clear()
