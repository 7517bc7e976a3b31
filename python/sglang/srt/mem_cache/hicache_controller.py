"""`HiCacheController`: the one interface through which KV pages and state snapshots move between the
device pools and the host tier (`HostPools`).

The scheduler never touches a tensor: `backup` and `load` only record a copy. The copies recorded up to
a batch's preparation are sealed into that batch (`seal`, called once per batch by the tree cache) and run
on the forward stream before its first layer (`run`, from the forward worker's before-batch hook), in the
order they were recorded, ahead of the batch's COW and clears. The tree's own state copies (`no_buffer`
snapshots) are recorded here too (`state_copy`): one ordered list, so a load into a slot freed and
handed out again never overtakes a copy out of it recorded earlier. FIFO order on the forward
stream is the whole synchronisation story, as for every other state move (docs/state_management.md):
- a load runs before the batch whose request hit it reads the pages or COWs the snapshot;
- a backup of a device page or slot that the tree gives up runs before any later batch writes it;
- a backup reads a snapshot only once the batch that writes it has run: checkpoints reach the tree after
  the copies of the batch writing them were sealed (or once it was processed); one filled by a state
  copy not yet sealed (`no_buffer`) is stamped with the `epoch` (batches sealed so far) and backed up
  only from the next one on.

On CUDA the copies run on a copy stream of their own, ordered after the forward stream's work so far, and
the forward stream waits for them before the batch: a batch waits for its own loads (and the backups
recorded with them), not for the scheduler. On CPU they are plain copies on the forward stream. The CUDA
path is written but untested here (no GPU in CI).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from sglang.srt.mem_cache.host_pool import HostPools


@dataclass
class HostCopy:
    """One recorded copy: `to_host` (a backup) or to the device (a load); KV token slots and state slots,
    device and host ids side by side."""

    to_host: bool
    device_kv: list[int]
    host_kv: list[int]
    device_slot: int | None
    host_slot: int | None


class HiCacheController:
    def __init__(self, host: HostPools):
        self.host = host
        self.recorded: list[HostCopy | Callable[[], None]] = []
        self.epoch = 0  # batches sealed so far
        self.stats: Counter = Counter()
        device = host.mamba_pool.conv_state.device
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def backup(self, device_kv: list[int], host_kv: list[int], device_slot: int, host_slot: int) -> None:
        self.recorded.append(HostCopy(True, device_kv, host_kv, device_slot, host_slot))
        self.stats["backup_tokens"] += len(device_kv)
        self.stats["backup_states"] += 1

    def load(self, host_kv: list[int], device_kv: list[int], host_slot: int, device_slot: int) -> None:
        self.recorded.append(HostCopy(False, device_kv, host_kv, device_slot, host_slot))
        self.stats["load_tokens"] += len(device_kv)
        self.stats["load_states"] += 1

    def state_copy(self, src: int, dst: int) -> None:
        """A device state copy of the tree's (a `no_buffer` snapshot: running slot -> checkpoint slot),
        run in order with the host copies: a load recorded earlier into `src` (a slot freed and handed
        out again) runs before it, a backup of `dst` recorded later after it."""
        self.recorded.append(partial(self.host.mamba_pool.copy_from, [src], [dst]))
        self.stats["state_copies"] += 1

    def record(self, op: Callable[[], None], stat: str) -> None:
        """Any other operation on the host tier's tensors (the disk tier's writes and reads), run on the
        forward stream in order with the copies."""
        self.recorded.append(op)
        self.stats[stat] += 1

    def seal(self) -> list[HostCopy | Callable[[], None]]:
        """Everything recorded so far, for the batch being prepared (`LaunchedBatch.host_copies`)."""
        out, self.recorded = self.recorded, []
        self.epoch += 1
        return out

    def clear(self) -> None:
        self.recorded = []

    # ---- forward stream ----------------------------------------------------------------------------

    def run(self, copies: list[HostCopy | Callable[[], None]]) -> None:
        if not copies:
            return
        if self.copy_stream is None:
            self._run(copies)
        else:
            forward = torch.cuda.current_stream(self.device)
            self.copy_stream.wait_stream(forward)
            with torch.cuda.stream(self.copy_stream):
                self._run(copies)
            forward.wait_stream(self.copy_stream)

    def _run(self, ops: list[HostCopy | Callable[[], None]]) -> None:
        """In recorded order; consecutive copies of one direction run as one gather per tensor, unless
        a destination repeats (a page or slot given up and handed out again in between: the later copy
        must win)."""
        i = 0
        while i < len(ops):
            if not isinstance(ops[i], HostCopy):
                ops[i]()
                i += 1
                continue
            j, kv_dst, slot_dst = i, set(), set()
            while j < len(ops) and isinstance(ops[j], HostCopy) and ops[j].to_host == ops[i].to_host:
                op = ops[j]
                kv = op.host_kv if op.to_host else op.device_kv
                slot = op.host_slot if op.to_host else op.device_slot
                if slot in slot_dst or not kv_dst.isdisjoint(kv):
                    break
                kv_dst.update(kv)
                slot_dst.add(slot)
                j += 1
            group = ops[i:j]
            dev_kv = [t for op in group for t in op.device_kv]
            host_kv = [t for op in group for t in op.host_kv]
            dev_s = [op.device_slot for op in group if op.device_slot is not None]
            host_s = [op.host_slot for op in group if op.host_slot is not None]
            # (index tensors only for what the group moves: each device one is an upload)
            if dev_kv:
                dk = torch.tensor(dev_kv, dtype=torch.int64).to(self.device)
                hk = torch.tensor(host_kv, dtype=torch.int64)
                if ops[i].to_host:
                    self.host.backup_kv(dk, hk)
                else:
                    self.host.load_kv(hk, dk)
            if dev_s:
                ds = torch.tensor(dev_s, dtype=torch.int64).to(self.device)
                hs = torch.tensor(host_s, dtype=torch.int64)
                if ops[i].to_host:
                    self.host.backup_states(ds, hs)
                else:
                    self.host.load_states(hs, ds)
            i = j
