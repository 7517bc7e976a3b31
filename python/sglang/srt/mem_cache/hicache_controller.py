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
  the copies of the batch writing them were sealed (or once it was processed); one filled by a
  `no_buffer` state copy has that copy recorded before any backup of it.

On CUDA the copies run on a copy stream of their own, ordered after the forward stream's work so far;
every transfer is one non-blocking copy per pool tensor through a pinned staging tensor (`HostPools`). The
forward stream waits (an event) for the batch's loads, state copies and the backups' device-side gathers
only: the backups' copies to host land while the batch runs and are scattered into the host pools once
their event completed, before a later disk operation reads or writes those pools or a load reads the rows
they write (a load of other rows waits for nothing: `_land_for_load`). On CPU the
same code runs with plain copies. The CUDA path is tested on a GPU only (`test_hicache_copies.py`,
`test_hicache_gpu.py`: run_gpu_checks.sh's `hicache` group; not yet run on a GPU).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

from sglang.srt.mem_cache.host_pool import HostPools


@dataclass
class HostOp:
    """A recorded operation on the host pools' tensors other than a copy (the disk tier's)."""

    fn: Callable[[], None]


class Gathered(NamedTuple):
    """A backup's rows gathered on the device (then on their way to host)."""

    kv: bool  # KV token slots, or state slots
    slots: torch.Tensor  # the host slots (a CPU tensor)
    rows: list[torch.Tensor]  # one per pool tensor
    ids: frozenset[int]  # `slots` as ints (which host rows a load must wait for; no host read of a tensor)


@dataclass
class HostCopy:
    """One recorded copy: `to_host` (a backup) or to the device (a load); KV token slots and state slots,
    device and host ids side by side."""

    to_host: bool
    device_kv: list[int]
    host_kv: list[int]
    device_slot: int
    host_slot: int


class HiCacheController:
    def __init__(self, host: HostPools):
        self.host = host
        self.recorded: list[HostCopy | HostOp | Callable[[], None]] = []
        # Backups on their way to host (CUDA): (event after their copies, what to scatter then), in order.
        self.landing: list[tuple[torch.cuda.Event, list[Gathered]]] = []
        self.stats: Counter = Counter()
        device = host.mamba_pool.conv_state.device
        self.device = device
        self.copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def backup(self, device_kv: list[int], host_kv: list[int], device_slot: int, host_slot: int) -> None:
        self.recorded.append(HostCopy(True, device_kv, host_kv, device_slot, host_slot))
        self.stats["backup_tokens"] += len(device_kv)
        self.stats["backup_states"] += 1
        self.stats["backup_bytes"] += len(device_kv) * self.host.token_bytes + self.host.slot_bytes

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
        forward stream in order with the copies (after every backup recorded before it has landed)."""
        self.recorded.append(HostOp(op))
        self.stats[stat] += 1

    def seal(self) -> list[HostCopy | HostOp | Callable[[], None]]:
        """Everything recorded so far, for the batch being prepared (`ScheduleBatch.host_copies`); the
        tree's reset drops them so."""
        out, self.recorded = self.recorded, []
        return out

    # ---- forward stream ----------------------------------------------------------------------------

    def run(self, copies: list[HostCopy | HostOp | Callable[[], None]]) -> None:
        """On the forward stream, before the batch they were sealed into. On CUDA on the copy stream: the
        forward stream waits for the loads, the state copies and the backups' gathers on the device (a
        page the tree gave up may be this batch's), not for the backups' copies to host, which land
        while the batch runs (scattered into the host pools by a later `run` or `wait`)."""
        self._land(block=False)
        if not copies:
            return
        if self.copy_stream is None:
            self._land_now(self._run(copies))
            return
        forward = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(forward)
        with torch.cuda.stream(self.copy_stream):
            gathered = self._run(copies)
            ready = torch.cuda.Event()
            ready.record()
            forward.wait_event(ready)
            moving = [g._replace(rows=self.host.to_host(g.rows)) for g in gathered]
            done = torch.cuda.Event()
            done.record()
        self.landing.append((done, moving))

    def wait(self) -> None:
        """Every copy run so far has landed, in the host pools and on the device (blocks)."""
        if self.copy_stream is not None:
            self.copy_stream.synchronize()
        self._land(block=True)

    def _land(self, block: bool, upto: int = 0) -> None:
        """Scatter backups whose copies to host completed into the host pools, in order (`block`: all;
        `upto`: at least the first `upto` entries, waiting for their events alone)."""
        while self.landing and (block or upto > 0 or self.landing[0][0].query()):
            event, moving = self.landing.pop(0)
            event.synchronize()
            for g in moving:
                self.host.scatter(g.kv, g.slots, g.rows)
            upto -= 1

    def _land_for_load(self, gathered: list[Gathered], host_kv: list[int], host_slots: list[int]) -> None:
        """Before a load reads the host rows `host_kv` / `host_slots`: the backups still to land that
        write any of them land first, with every one before them (in order); the others stay in flight.
        A backup of this `run` writing them lands everything now (its copy waits for the forward stream's
        work so far: the one case where the load blocks on the previous batch); one of an earlier `run`
        waits for that run's event alone; a load of rows no backup writes waits for nothing."""
        kv, slot = set(host_kv), set(host_slots)

        def writes(moving: list[Gathered]) -> bool:
            return any(not (kv if g.kv else slot).isdisjoint(g.ids) for g in moving)

        if writes(gathered):
            self._land_now(gathered)
            return
        last = max((i + 1 for i, (_, moving) in enumerate(self.landing) if writes(moving)), default=0)
        self._land(block=False, upto=last)

    def _land_now(self, gathered: list[Gathered]) -> None:
        """Backups gathered by this `run` into the host pools now (before an op that reads or writes them),
        after every earlier one."""
        self._land(block=True)
        moving = [g._replace(rows=self.host.to_host(g.rows)) for g in gathered]
        if moving and self.copy_stream is not None:
            torch.cuda.current_stream(self.device).synchronize()
        for g in moving:
            self.host.scatter(g.kv, g.slots, g.rows)
        gathered.clear()

    def _run(self, ops: list[HostCopy | HostOp | Callable[[], None]]) -> list[Gathered]:
        """In recorded order; consecutive copies of one direction run as one gather per tensor, unless
        a destination repeats (a page or slot given up and handed out again in between: the later copy
        must win). Returns the backups' gathered rows, not yet in the host pools; a disk operation (which
        rows it touches is its own) first lands every backup before it, a load those writing the host
        rows it reads (`_land_for_load`)."""
        gathered: list[Gathered] = []
        i = 0
        while i < len(ops):
            op = ops[i]
            if isinstance(op, HostOp):
                self._land_now(gathered)
                op.fn()
                i += 1
                continue
            if not isinstance(op, HostCopy):
                op()  # (a device state copy)
                i += 1
                continue
            j, kv_dst, slot_dst = i, set(), set()
            while j < len(ops) and isinstance(ops[j], HostCopy) and ops[j].to_host == op.to_host:
                kv = ops[j].host_kv if op.to_host else ops[j].device_kv
                slot = ops[j].host_slot if op.to_host else ops[j].device_slot
                if slot in slot_dst or not kv_dst.isdisjoint(kv):
                    break
                kv_dst.update(kv)
                slot_dst.add(slot)
                j += 1
            group = ops[i:j]
            if not op.to_host:
                self._land_for_load(gathered, [t for g in group for t in g.host_kv], [g.host_slot for g in group])
            moves = (
                (True, [t for g in group for t in g.device_kv], [t for g in group for t in g.host_kv]),
                (False, [g.device_slot for g in group], [g.host_slot for g in group]),
            )
            for kv, dev, host in moves:
                if not dev:
                    continue  # (index tensors only for what the group moves: each device one is an upload)
                dev_idx = torch.tensor(dev, dtype=torch.int64).to(self.device)
                host_idx = torch.tensor(host, dtype=torch.int64)
                if op.to_host:
                    gathered.append(Gathered(kv, host_idx, self.host.gather(kv, dev_idx), frozenset(host)))
                elif kv:
                    self.host.load_kv(host_idx, dev_idx)
                else:
                    self.host.load_states(host_idx, dev_idx)
            i = j
        return gathered
