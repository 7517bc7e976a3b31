"""`LoRASlots`: the scheduler's side of LoRA serving (upstream's rules), one owner for which adapter is in
which device slot and which requests may run together.

- A batch runs at most --max-loras-per-batch adapters, the base model counting as one (upstream's
  rule). A waiting request whose adapter would go over that, or finds no slot free or freeable, is
  passed over in this admission pass and waits (`admits`).
- A slot is freeable when no running request (the running set, the request mid-prefill, those
  admitted in this pass) uses its adapter and the adapter is not pinned; the one to free is the least
  recently admitted (`lru`) or the first loaded (`fifo`), --lora-eviction-policy. The copy of an
  adapter into its slot rides with the batch that first runs it (`take_loads`), so it is ordered on
  the forward stream after every batch still reading the slot's previous adapter.
- Adapters load and unload on every rank alike (every rank runs this same scheduler). An unloaded
  adapter's name is gone from the tokenizer at once (new requests are refused); its requests already
  sent finish with it, and its weights and slot are freed once none is left (`collect`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

from sglang.srt.lora.lora_config import LoRAAdapterError

if TYPE_CHECKING:
    from sglang.srt.lora.lora_manager import LoRAManager
    from sglang.srt.managers.req import Req
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)


class LoRASlots:
    def __init__(self, manager: LoRAManager, args: ServerArgs):
        self.manager = manager
        self.max_per_batch = args.max_loras_per_batch
        self.policy = args.lora_eviction_policy
        self.max_loaded = args.max_loaded_loras
        self.slots: list[str | None] = [None] * args.max_loras_per_batch
        self.names: dict[str, str] = {}  # uid -> name, of every adapter held
        self.pinned: set[str] = set()
        self.unloading: set[str] = set()
        self.clock = 0
        self.last_used: dict[str, int] = {}  # uid -> clock of its last admission
        self.loaded_at: dict[int, int] = {}  # slot -> clock of its adapter's copy
        self.pending: list[tuple[int, str | None]] = []
        for ref in args.lora_refs:
            error = self.load(ref.lora_id, ref.lora_name, ref.lora_path, ref.pinned)
            if error is not None:
                raise ValueError(error)

    # ---- loads -----------------------------------------------------------------------------------

    def load(self, uid: str, name: str, path: str, pinned: bool = False) -> str | None:
        """Read adapter `name` under `uid`; None, or why not (one sentence)."""
        if self.max_loaded is not None and len(self.names) >= self.max_loaded:
            return f"{len(self.names)} adapters are loaded, the limit of --max-loaded-loras; unload one first."
        if pinned and len(self.pinned) + 1 >= self.max_per_batch:
            return (
                f"{len(self.pinned)} adapters are pinned; at most --max-loras-per-batch - 1 = "
                f"{self.max_per_batch - 1} may be (one slot stays for the others)."
            )
        try:
            self.manager.load(uid, name, path)
        except (LoRAAdapterError, OSError) as e:
            return str(e)
        except Exception as e:  # noqa: BLE001 - a malformed file (safetensors, shapes): refused, never a crash
            logger.exception("LoRA adapter %r could not be loaded from %s.", name, path)
            return f"LoRA adapter {name!r} could not be loaded from {path}: {type(e).__name__}: {e}"
        self.names[uid] = name
        if pinned:
            self.pinned.add(uid)
        return None

    def forget(self, uid: str) -> None:
        """Drop `uid` at once (a load the other TP ranks failed: no request has it yet)."""
        self.names.pop(uid, None)
        self.pinned.discard(uid)
        self.manager.unload(uid)

    def unload(self, uid: str) -> None:
        """Refuse `uid` from now on; freed once its last request is gone (`collect`)."""
        if uid in self.names:
            self.unloading.add(uid)
            self.pinned.discard(uid)

    def collect(self, holders: Iterable[Req]) -> None:
        """Free the unloaded adapters no request in `holders` (every request the scheduler holds) uses."""
        if not self.unloading:
            return
        used = {r.lora_id for r in holders}
        for uid in [u for u in self.unloading if u not in used]:
            self.unloading.discard(uid)
            self.names.pop(uid, None)
            self.last_used.pop(uid, None)
            self.manager.unload(uid)
            if uid in self.slots:
                slot = self.slots.index(uid)
                self.slots[slot] = None
                self.pending.append((slot, None))
            logger.info("LoRA adapter %s unloaded.", uid)

    def knows(self, uid: str | None) -> bool:
        return uid is None or uid in self.names

    # ---- admission -------------------------------------------------------------------------------

    def admits(self, req: Req, used: set[str | None]) -> bool:
        """Whether `req` may join a batch whose requests (those running and admitted so far) run the
        adapters `used` (None: the base model)."""
        if req.lora_id in used:
            return True
        if len(used) + 1 > self.max_per_batch:
            return False
        return req.lora_id is None or req.lora_id in self.slots or self._free_slot(used) is not None

    def acquire(self, req: Req, used: set[str | None]) -> None:
        """Give admitted `req` its adapter's slot (`req.lora_slot`; -1: the base model), copying the
        adapter in with this batch where no slot holds it. `admits(req, used)` said yes."""
        uid = req.lora_id
        if uid is None:
            req.lora_slot = -1
            return
        self.clock += 1
        self.last_used[uid] = self.clock
        if uid not in self.slots:
            slot = self._free_slot(used)
            assert slot is not None, "acquire without admits"
            self.slots[slot] = uid
            self.loaded_at[slot] = self.clock
            self.pending.append((slot, uid))
        req.lora_slot = self.slots.index(uid)

    def take_loads(self) -> list[tuple[int, str | None]]:
        loads, self.pending = self.pending, []
        return loads

    def _free_slot(self, used: set[str | None]) -> int | None:
        if None in self.slots:
            return self.slots.index(None)
        free = [i for i, uid in enumerate(self.slots) if uid not in used and uid not in self.pinned]
        if not free:
            return None
        if self.policy == "fifo":
            return min(free, key=lambda i: self.loaded_at.get(i, 0))
        return min(free, key=lambda i: self.last_used.get(self.slots[i], 0))
