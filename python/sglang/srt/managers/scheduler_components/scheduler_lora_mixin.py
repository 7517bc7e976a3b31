"""The scheduler's LoRA parts, a part of the `Scheduler` class kept in its own file (as upstream's
scheduler mixins): the adapter slots (`LoRASlots`, which owns the rules), the admission hooks, the
load and unload calls."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from sglang.srt.managers.io_struct import (
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    UnloadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqOutput,
)
from sglang.srt.managers.scheduler_components.lora_slots import LoRASlots

if TYPE_CHECKING:
    from sglang.srt.managers.req import Req
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.managers.schedule_policy import PrefillAdder

logger = logging.getLogger(__name__)


class SchedulerLoRAMixin:
    def init_lora(self) -> None:
        manager = getattr(self.model_runner, "lora", None)
        self.lora = LoRASlots(manager, self.server_args) if manager is not None else None
        self._lora_pass: tuple[PrefillAdder, set[str | None]] | None = None

    def _lora_used(self, adder: PrefillAdder | None = None) -> set[str | None]:
        """The adapters a new request would run beside (the running requests', the one mid-prefill's,
        this pass's): built once per admission pass, then kept up by `lora_acquire` (it was rebuilt
        from every running request for each request the pass looked at)."""
        if adder is not None and self._lora_pass is not None and self._lora_pass[0] is adder:
            return self._lora_pass[1]
        chunked = [self.chunked_req] if self.chunked_req is not None else []
        used = {r.lora_id for r in (*self.running, *chunked, *(adder.reqs if adder is not None else ()))}
        if adder is not None:
            self._lora_pass = (adder, used)
        return used

    def lora_admits(self, req: Req, adder: PrefillAdder) -> bool:
        return self.lora is None or self.lora.admits(req, self._lora_used(adder))

    def lora_acquire(self, req: Req, adder: PrefillAdder) -> None:
        if self.lora is not None:
            used = self._lora_used(adder)
            self.lora.acquire(req, used)
            used.add(req.lora_id)

    def lora_fits_running(self, req: Req) -> bool:
        """Whether `req`'s adapter may join the running requests (priority preemption makes room for a
        request, never adapter slots: one whose adapter does not fit waits, preempting nobody)."""
        return self.lora is None or self.lora.admits(req, self._lora_used())

    def lora_collect(self) -> None:
        """Free the unloaded adapters no request holds: every request the scheduler knows (its grammar
        compiling too) and the finished ones whose release waits for a batch in flight."""
        if self.lora is not None and self.lora.unloading:  # (every step: nothing to do but this check)
            self.lora.collect(self.live_requests())

    def lora_seal(self, batch: ScheduleBatch) -> None:
        """The new prefill batch carries the adapter copies into slots it needs."""
        if self.lora is not None:
            batch.forward_batch.lora_loads = self.lora.take_loads()

    def lora_refusal(self, req: Req) -> str | None:
        """Why a request's adapter cannot run (unloaded after the request was sent), or None."""
        if req.lora_id is None or (self.lora is not None and self.lora.knows(req.lora_id)):
            return None
        return "The LoRA adapter of this request was unloaded before it could run."

    def process_lora_message(self, obj: Any) -> bool:
        """Answer a load or unload call; False where `obj` is neither."""
        if isinstance(obj, LoadLoRAAdapterReqInput):
            self.lora_collect()  # (an unloaded adapter no request holds gives back its place first)
            error = "LoRA is not enabled (start the server with --enable-lora)." if self.lora is None else None
            error = error or self.lora.load(obj.lora_id, obj.lora_name, obj.lora_path, obj.pinned)
            if self.tp is not None and self.lora is not None:  # (every rank runs this message: they agree)
                agreed = self.tp.agree_outcome(error, "the adapter is loaded on no rank")
                if agreed is not None and error is None:
                    self.lora.forget(obj.lora_id)
                error = agreed
            self.send_to_tokenizer(LoadLoRAAdapterReqOutput(error is None, error or ""))
        elif isinstance(obj, UnloadLoRAAdapterReqInput):
            if self.lora is not None:
                self.lora.unload(obj.lora_id)
                self.lora_collect()  # (freed now where no request holds it)
            self.send_to_tokenizer(UnloadLoRAAdapterReqOutput(self.lora is not None))
        else:
            return False
        return True
