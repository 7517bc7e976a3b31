"""The TokenizerManager's control calls, at upstream's module name: pausing and continuing generation,
and the weight and memory calls (upstream's RL refit routes): updates from disk, tensors and a trainer's
process group, reads of a parameter, memory release and resume, the weight version; the profiler's start
and stop, the expert distribution recorder, and /freeze_gc. Each holds new requests at the
TokenizerManager's gates while it needs to, and goes to the scheduler as a control call
(`TokenizerManager._control`)."""

from __future__ import annotations

import gc
from typing import Any, Protocol

from sglang.srt.managers.io_struct import (
    ContinueGenerationReqInput,
    ContinueGenerationReqOutput,
    DestroyWeightsUpdateGroupReqInput,
    DestroyWeightsUpdateGroupReqOutput,
    ExpertDistributionReq,
    ExpertDistributionReqOutput,
    FreezeGCReq,
    FreezeGCReqOutput,
    GetWeightsByNameReqInput,
    GetWeightsByNameReqOutput,
    InitWeightsUpdateGroupReqInput,
    InitWeightsUpdateGroupReqOutput,
    LoadLoRAAdapterReqInput,
    LoadLoRAAdapterReqOutput,
    PauseGenerationReqInput,
    PauseGenerationReqOutput,
    ProfileReq,
    ProfileReqOutput,
    ReleaseMemoryOccupationReqInput,
    ReleaseMemoryOccupationReqOutput,
    ResumeMemoryOccupationReqInput,
    ResumeMemoryOccupationReqOutput,
    UnloadLoRAAdapterReqInput,
    UnloadLoRAAdapterReqOutput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromDistributedReqOutput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightsFromTensorReqOutput,
)
from sglang.srt.managers.request_validation import RequestError

CONTROL_TIMEOUT_S = 30.0


class DisconnectCheck(Protocol):
    """What a call can ask of the HTTP request it serves (a Starlette `Request`)."""

    async def is_disconnected(self) -> bool: ...


class TokenizerCommunicatorMixin:
    """Mixed into `TokenizerManager`, whose gates, locks and control calls these use."""

    async def pause_generation(self, mode: str, timeout: float = CONTROL_TIMEOUT_S) -> None:
        """Upstream's modes: "abort" aborts every request and holds new ones here; "retract" and
        "in_place" pause the scheduler (see `PauseGenerationReqInput`). New requests wait in every mode
        until `continue_generation`. A pause that fails (TimeoutError) leaves the pause state as it was."""
        was_paused = not self._unpaused.is_set()
        self._unpaused.clear()
        try:
            if mode != "abort":
                await self._control(PauseGenerationReqInput(mode), PauseGenerationReqOutput, timeout)
                self._scheduler_paused = True
                return
            # One abort suffices: it follows every request already sent on the same ordered socket.
            self.abort_request(abort_all=True)
            if not await self._wait_until(self._all_finished, None, timeout):
                raise TimeoutError(f"Requests were still running {timeout:.0f} s after they were aborted.")
        except BaseException:
            if not was_paused:
                self._unpaused.set()
            raise

    async def continue_generation(self, timeout: float = CONTROL_TIMEOUT_S) -> None:
        """Resume: new requests go through again even if the scheduler does not answer (its own pause,
        if any, then holds them in its queue)."""
        try:
            if self._scheduler_paused:  # an "abort" pause never reached the scheduler
                await self._control(ContinueGenerationReqInput(), ContinueGenerationReqOutput, timeout)
                self._scheduler_paused = False
        finally:
            self._unpaused.set()

    async def update_weights_from_disk(
        self, obj: UpdateWeightFromDiskReqInput, request: DisconnectCheck | None = None
    ) -> tuple[bool, str, int]:
        """Serve the checkpoint at `obj.model_path`: (success, message, requests paused meanwhile).

        As upstream: unless the server is paused or `is_async`, new requests wait while the requests
        already running finish (with the old weights), then the scheduler swaps the weights (loading
        them on a thread of its own) and empties the prefix cache; the waiting requests then run with
        the new ones; a pause that comes meanwhile ends the wait. With `abort_all_requests` everything
        running is aborted first; with `keep_pause` the server is paused after a successful update. A
        failed update leaves the old weights serving. One update at a time."""
        out = await self._update_weights(obj, UpdateWeightFromDiskReqOutput, request)
        if out.success:
            self.server_args.model_path = obj.model_path
        return out.success, out.message, out.num_paused_requests

    async def update_weights_from_tensor(
        self, obj: UpdateWeightsFromTensorReqInput, request: DisconnectCheck | None = None
    ) -> tuple[bool, str]:
        """New values for some or all weights, written in place (`Scheduler.update_weights_from_tensor`):
        (success, message). New requests wait while the running ones finish, as for
        `update_weights_from_disk` (upstream holds its writer lock likewise)."""
        out = await self._update_weights(obj, UpdateWeightsFromTensorReqOutput, request)
        return out.success, out.message

    async def init_weights_update_group(
        self, obj: InitWeightsUpdateGroupReqInput, request: DisconnectCheck | None = None
    ) -> tuple[bool, str]:
        """Join a trainer's weight-update group (`WeightsUpdateGroups`): waits while the trainer joins,
        up to the group's timeout (30 min by default). A second call meanwhile is answered at once rather
        than queued behind the first for as long."""
        joining = self._control_locks.get(InitWeightsUpdateGroupReqOutput)
        if joining is not None and joining.locked():
            return False, "A weight-update group is being joined already; call again once that call answers."
        out = await self._control(obj, InitWeightsUpdateGroupReqOutput, None)
        return out.success, out.message

    async def update_weights_from_distributed(
        self, obj: UpdateWeightsFromDistributedReqInput, request: DisconnectCheck | None = None
    ) -> tuple[bool, str]:
        """Weights broadcast by the trainer over a weight-update group, written in place; new requests
        wait while the running ones finish, as for the other weight updates."""
        out = await self._update_weights(obj, UpdateWeightsFromDistributedReqOutput, request)
        return out.success, out.message

    async def destroy_weights_update_group(
        self, obj: DestroyWeightsUpdateGroupReqInput, request: DisconnectCheck | None = None
    ) -> tuple[bool, str]:
        out = await self._control(obj, DestroyWeightsUpdateGroupReqOutput, CONTROL_TIMEOUT_S)
        return out.success, out.message

    async def get_weights_by_name(
        self, obj: GetWeightsByNameReqInput, request: DisconnectCheck | None = None
    ) -> list:
        """Upstream's: the parameter's first rows (nested float lists). RequestError naming `name` where
        the model has no such parameter (upstream answers None and a bare 400)."""
        # No time limit: a reply that came after its waiter gave up would answer the next call.
        out = await self._control(obj, GetWeightsByNameReqOutput, None)
        if out.parameter is None:
            raise RequestError(out.message, "name")
        return out.parameter

    async def load_lora_adapter(
        self, obj: LoadLoRAAdapterReqInput, request: DisconnectCheck | None = None
    ) -> tuple[bool, str, dict[str, str]]:
        """Upstream's /load_lora_adapter: every rank reads the adapter (under a new id); the name serves
        once they all have. (success, error_message, loaded_adapters)."""
        registry = self.lora
        if not registry.enabled:
            return False, "LoRA is not enabled (start the server with --enable-lora).", {}
        if obj.lora_name in registry.adapters:
            return False, f"LoRA adapter {obj.lora_name!r} is already loaded; unload it first.", registry.loaded()
        obj.lora_id = registry.new_id(obj.lora_name)
        out = await self._control(obj, LoadLoRAAdapterReqOutput, None)  # (a large adapter reads a while)
        if out.success and obj.lora_name not in registry.adapters:
            registry.add(obj.lora_name, obj.lora_id, obj.lora_path, obj.pinned)
            return True, "", registry.loaded()
        # Not served: a failure (with --dp-size, the replicas that did load it free it again), or the same
        # name loaded meanwhile by another call.
        await self._control(UnloadLoRAAdapterReqInput(obj.lora_name, obj.lora_id), UnloadLoRAAdapterReqOutput, None)
        if out.success:
            return False, f"LoRA adapter {obj.lora_name!r} is already loaded; unload it first.", registry.loaded()
        return False, out.error_message, registry.loaded()

    async def unload_lora_adapter(
        self, obj: UnloadLoRAAdapterReqInput, request: DisconnectCheck | None = None
    ) -> tuple[bool, str, dict[str, str]]:
        """Upstream's /unload_lora_adapter: the name is refused from now on; requests sent before run to
        their end with the adapter, whose memory is freed after the last of them."""
        registry = self.lora
        adapter = registry.remove(obj.lora_name) if registry.enabled else None
        if adapter is None:
            return False, f"LoRA adapter {obj.lora_name!r} is not loaded.", registry.loaded()
        obj.lora_id = adapter.lora_id
        out = await self._control(obj, UnloadLoRAAdapterReqOutput, None)
        return out.success, out.error_message, registry.loaded()

    async def freeze_gc(self) -> FreezeGCReqOutput:
        """Upstream's: after a warm-up, every process (this one, the schedulers, the detokenizer) moves
        the objects it holds out of the cyclic collector's reach, so that its full collections, which
        stall a process while they walk every object, walk only what is made later."""
        gc.freeze()
        return await self._control(FreezeGCReq(), FreezeGCReqOutput, CONTROL_TIMEOUT_S)

    async def expert_distribution(self, action: str) -> ExpertDistributionReqOutput:
        """The expert distribution recorder's "start", "stop" or "dump" (a dump's message: its file)."""
        return await self._control(ExpertDistributionReq(action), ExpertDistributionReqOutput, CONTROL_TIMEOUT_S)

    async def start_profile(self, req: ProfileReq) -> ProfileReqOutput:
        """Start the schedulers' torch profiler (`req` checked by `profile_request`); no time limit."""
        return await self._control(req, ProfileReqOutput, None)

    async def stop_profile(self) -> ProfileReqOutput:
        """Stop it: the reply comes once every rank has written its trace (no time limit: a long
        profile takes a while to write)."""
        return await self._control(ProfileReq(type="stop"), ProfileReqOutput, None)

    async def release_memory_occupation(
        self, obj: ReleaseMemoryOccupationReqInput, request: DisconnectCheck | None = None
    ) -> tuple[bool, str]:
        """Free the memory of `obj.tags` (no request may run or wait); new requests wait until it is
        all resumed: held from before the release is sent, so none slips into a scheduler that cannot
        run it. No time limit: a host copy of large weights takes a while."""
        return await self._memory_occupation(obj, ReleaseMemoryOccupationReqOutput)

    async def resume_memory_occupation(
        self, obj: ResumeMemoryOccupationReqInput, request: DisconnectCheck | None = None
    ) -> tuple[bool, str]:
        return await self._memory_occupation(obj, ResumeMemoryOccupationReqOutput)

    async def _memory_occupation(self, obj: Any, reply_type: type) -> tuple[bool, str]:
        """One release or resume at a time; the gate follows what the scheduler says is released after
        each (closed from before a release is sent, so no request slips into a scheduler that cannot
        run it; open again if the scheduler cannot say)."""
        async with self._memory_lock:
            if isinstance(obj, ReleaseMemoryOccupationReqInput):
                self._memory_resumed.clear()
            out = None
            try:
                out = await self._control(obj, reply_type, None)
            finally:
                if out is not None and out.released:
                    self._memory_resumed.clear()
                else:
                    self._memory_resumed.set()
        return out.success, out.message

    async def _update_weights(self, obj: Any, reply_type: type, request: DisconnectCheck | None) -> Any:
        async with self._weight_update_lock:
            if obj.abort_all_requests:
                self.abort_request(abort_all=True)
            # (Nothing runs while memory is released: a request that reached the scheduler just before
            # waits there, and must not hold the update the resume waits for.)
            hold = self._unpaused.is_set() and self._memory_resumed.is_set()
            hold = hold and not getattr(obj, "is_async", False)
            if hold:
                self._no_update_hold.clear()
            try:
                if hold:
                    # Until every running request has finished, or a pause (of any mode) comes first.
                    paused_or_done = lambda: not self._unpaused.is_set() or self._all_finished()  # noqa: E731
                    await self._wait_until(paused_or_done, request)
                out = await self._control(obj, reply_type, None)
            finally:
                self._no_update_hold.set()
            if out.success:
                if obj.weight_version is not None:
                    self.server_args.weight_version = obj.weight_version
                if getattr(obj, "keep_pause", False):
                    self._unpaused.clear()  # (as an "abort" pause: /continue_generation ends it)
            return out

    def update_weight_version(self, new_version: str, abort_all_requests: bool = True) -> None:
        """Upstream's /update_weight_version: the label replies carry from now on (running requests are
        aborted first unless told not to)."""
        if abort_all_requests:
            self.abort_request(abort_all=True)
        self.server_args.weight_version = new_version
