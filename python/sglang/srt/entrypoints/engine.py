"""`sglang.Engine`: the runtime for offline use, without HTTP.

    engine = sglang.Engine(model_path="tiny-qwen3-next", mamba_scheduler_strategy="extra_buffer_lazy")
    out = engine.generate("Hello", {"max_new_tokens": 8, "temperature": 0})
    for chunk in engine.generate("Hello", {"max_new_tokens": 8}, stream=True): ...
    engine.shutdown()

The scheduler and detokenizer run as subprocesses (as in the server); the TokenizerManager runs in this
process on a private event loop in a background thread, so the sync API works anywhere (scripts,
notebooks, inside another running loop) and `async_generate` works from any loop.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any

from sglang.srt.entrypoints.process_launcher import SchedulerEntry, ServerStartupError, launch_subprocesses
from sglang.srt.entrypoints.server_info import build_server_info
from sglang.srt.lora.lora_registry import parse_load_lora_adapter, parse_unload_lora_adapter
from sglang.srt.managers.io_struct import (
    ExpertDistributionReqOutput,
    FlushCacheReqOutput,
    GenerateReqInput,
    OpenSessionReqInput,
    ProfileReqOutput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
)
from sglang.srt.managers.profile_request import parse_profile_request
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.managers.weight_update_request import (
    check_tensor_load_format,
    parse_destroy_weights_update_group,
    parse_get_weights_by_name,
    parse_init_weights_update_group,
    parse_memory_occupation,
    parse_update_weights_from_disk,
    parse_update_weights_from_distributed,
)
from sglang.srt.server_args import ServerArgs
from sglang.srt.server_args_upstream import upstream_engine_kwargs

# The reply of /load_lora_adapter and /unload_lora_adapter (upstream's fields).
LORA_REPLY = ("success", "error_message", "loaded_adapters")


class Engine:
    def __init__(self, *, scheduler_entry: SchedulerEntry | None = None, **kwargs: Any):
        """`kwargs` are ServerArgs fields (`model_path=...`, `mamba_scheduler_strategy=...`) or upstream's
        keywords (`upstream_engine_kwargs`); a bad one raises ServerArgsError, a failed start
        ServerStartupError."""
        self.server_args = ServerArgs(**upstream_engine_kwargs(kwargs))
        if self.server_args.node_rank > 0:
            raise ServerStartupError(
                f"--node-rank {self.server_args.node_rank}: an Engine runs on node 0; start the other "
                "nodes' ranks with python -m sglang.launch_server and the same --nnodes and --dist-init-addr."
            )
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._launched = launch_subprocesses(self.server_args, scheduler_entry)
        atexit.register(self.shutdown)
        try:
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="sglang-engine-loop", daemon=True
            )
            self._thread.start()
            self.tokenizer_manager = TokenizerManager(
                self.server_args,
                self._launched.port_args,
                self._launched.model_info,
                self._launched.failure,
            )
            if self.server_args.max_samples_per_request is None:
                # The bound keeps one HTTP client from holding the event loop others share; an Engine's
                # caller is its only client, and upstream's Engine takes a batch of any size.
                self.tokenizer_manager.max_samples_per_request = None
            self._run(self.tokenizer_manager.start())
        except BaseException:
            self.shutdown()
            raise

    # ---- generation --------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_text_in_logprobs: bool = False,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_hidden_states: bool | list[bool] = False,
        extra_key: str | list[str] | None = None,
        cache_salt: str | list[str] | None = None,
        image_data: Any = None,
        video_data: Any = None,
        priority: int | list[int] | None = None,
        lora_path: str | list[str | None] | None = None,
        return_routed_experts: bool | list[bool] = False,
        session_params: dict | list[dict | None] | None = None,
        require_reasoning: bool | list[bool] = False,
        max_thinking_tokens: int | list[int | None] | None = None,
    ) -> dict | list[dict] | Iterator[dict]:
        """One prompt gives a dict, a batch (or n > 1) a list; with stream=True an iterator of chunks
        (text and output_ids cumulative; logprob lists and hidden states only what is new, the input
        ones once: docs/server.md). Bad input raises RequestError (naming the field) at the call. As upstream's:
        `return_hidden_states` (with enable_return_hidden_states), and the cache namespace of
        `extra_key` / `cache_salt`, `priority` (--enable-priority-scheduling; docs/server.md), and
        `lora_path`, a loaded LoRA adapter's name (--enable-lora; docs/lora.md), and
        `return_routed_experts` (with enable_return_routed_experts: meta_info["routed_experts"]), and
        `session_params`, which continues an earlier request of a session (`open_session`), and the
        reasoning control `require_reasoning` / `max_thinking_tokens` (constrained/reasoning_grammar.py)."""
        obj = _make_obj(**{k: v for k, v in locals().items() if k != "self"})
        if not stream:
            return self._run(_first(self.tokenizer_manager.generate_request(obj, trusted=True)))
        agen = self.tokenizer_manager.generate_request(obj, trusted=True)
        try:
            first = self._run(agen.__anext__())
        except StopAsyncIteration:
            return iter(())
        return self._sync_stream(agen, first)

    def score(
        self,
        query: str | list[int],
        items: str | list[str] | list[list[int]],
        label_token_ids: list[int],
        apply_softmax: bool = False,
        item_first: bool = False,
    ) -> list[list[float]]:
        """Upstream's scoring: per item, each label token's probability as the next token after
        query + item (`serving_score.py`; /v1/score)."""
        from sglang.srt.entrypoints.openai.serving_score import ScoringRequest, scores_of, scoring_input

        req = ScoringRequest(query=query, items=items, label_token_ids=label_token_ids,
                             apply_softmax=apply_softmax, item_first=item_first)  # fmt: skip
        obj = self._run(scoring_input(self.tokenizer_manager, req))
        out = self._run(_first(self.tokenizer_manager.generate_request(obj, trusted=True)))
        return scores_of(out if isinstance(out, list) else [out], req.label_token_ids, apply_softmax)

    def _sync_stream(self, agen: AsyncIterator[dict], first: dict) -> Iterator[dict]:
        try:
            yield first
            while True:
                try:
                    chunk = self._run(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            # Closing the iterator early aborts the request (TokenizerManager's finally).
            if not self._closed:
                self._run(agen.aclose())

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool | list[bool] = False,
        logprob_start_len: int | list[int] | None = None,
        top_logprobs_num: int | list[int] | None = None,
        stream: bool = False,
        rid: str | list[str] | None = None,
        return_text_in_logprobs: bool = False,
        token_ids_logprob: list[int] | list[list[int]] | None = None,
        return_hidden_states: bool | list[bool] = False,
        extra_key: str | list[str] | None = None,
        cache_salt: str | list[str] | None = None,
        priority: int | list[int] | None = None,
        lora_path: str | list[str | None] | None = None,
        return_routed_experts: bool | list[bool] = False,
        session_params: dict | list[dict | None] | None = None,
        require_reasoning: bool | list[bool] = False,
        max_thinking_tokens: int | list[int | None] | None = None,
    ) -> dict | list[dict] | AsyncIterator[dict]:
        """As `generate`, from any event loop; with stream=True, await it for an async iterator."""
        obj = _make_obj(**{k: v for k, v in locals().items() if k != "self"})
        if not stream:
            return await self._await(_first(self.tokenizer_manager.generate_request(obj, trusted=True)))
        agen = self.tokenizer_manager.generate_request(obj, trusted=True)
        try:
            first = await self._await(agen.__anext__())
        except StopAsyncIteration:
            first = None
        return self._async_stream(agen, first)

    async def _async_stream(self, agen: AsyncIterator[dict], first: dict | None) -> AsyncIterator[dict]:
        try:
            if first is None:
                return
            yield first
            while True:
                try:
                    chunk = await self._await(agen.__anext__())
                except StopAsyncIteration:
                    return
                yield chunk
        finally:
            if not self._closed:
                await self._await(agen.aclose())

    # ---- control -----------------------------------------------------------------------------------

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        self._loop.call_soon_threadsafe(self.tokenizer_manager.abort_request, rid, abort_all)

    def open_session(
        self, capacity_of_str_len: int = 0, session_id: str | None = None, streaming: bool = False,
        timeout: float | None = None,
    ) -> str:  # fmt: skip
        """Upstream's: open a session (`generate(session_params={"id": ...})` continues its requests) and
        return its id; RequestError naming the field (a duplicate id, `streaming`: not supported)."""
        obj = OpenSessionReqInput(capacity_of_str_len, session_id, streaming, timeout)
        return self._run(_call(self.tokenizer_manager.sessions.open, obj))

    def close_session(self, session_id: str) -> None:
        self._run(_call(self.tokenizer_manager.sessions.close, session_id))

    def flush_cache(self) -> FlushCacheReqOutput:
        """Empty the prefix cache; fails (success=False) while requests are running."""
        return self._run(self.tokenizer_manager.flush_cache())

    def update_weights_from_disk(self, model_path: str, load_format: str | None = None, **kwargs: Any):
        """Serve the checkpoint at `model_path` (the same network, new weights): (success, message,
        num_paused_requests), as upstream's. `kwargs`: the other fields of /update_weights_from_disk
        (flush_cache, abort_all_requests, weight_version, is_async, keep_pause); a wrong value raises
        RequestError naming it, an unknown name TypeError."""
        known = {f.name for f in dataclasses.fields(UpdateWeightFromDiskReqInput)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"update_weights_from_disk() got an unexpected keyword argument {unknown[0]!r}")
        obj = parse_update_weights_from_disk({"model_path": model_path, "load_format": load_format, **kwargs})
        return self._run(self.tokenizer_manager.update_weights_from_disk(obj))

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, Any]], load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        """Upstream's: write new values into some or all weights, in place; (success, message).
        `named_tensors`: (checkpoint name, tensor) pairs, on any device: they reach the scheduler by
        handle (shared memory, CUDA IPC), not by copy (a CPU tensor's storage moves to shared memory, as
        with torch.multiprocessing). `load_format` "direct": this server's parameter names and layout;
        "flattened_bucket": `named_tensors` are payloads serialized already, each a
        FlattenedTensorBucket's dict (`sglang.srt.weight_sync.tensor_bucket`), as upstream takes them.
        New requests wait while the running ones finish; the prefix cache is then emptied unless
        `flush_cache` is false."""
        from sglang.srt.managers.scheduler_components.weight_update import first_non_pair
        from sglang.srt.utils.multiprocessing_serializer import MultiprocessingSerializer

        check_tensor_load_format(load_format)
        named = list(named_tensors)
        if load_format == "flattened_bucket":  # as upstream: the payloads, serialized already (one per rank)
            if not named or not all(isinstance(p, (str, bytes)) for p in named):
                raise TypeError("with load_format 'flattened_bucket', named_tensors are serialized payloads")
            payloads = named
        else:
            bad = first_non_pair(named)
            if bad is not None:
                raise TypeError(f"named_tensors[{bad}] is not a (name, tensor) pair")
            # As upstream, one payload per TP rank (and here per replica): a payload's handles open once.
            ranks = self.server_args.tp_size * self.server_args.dp_size
            payloads = [MultiprocessingSerializer.serialize(named) for _ in range(ranks)]
        obj = UpdateWeightsFromTensorReqInput(payloads, load_format=load_format, flush_cache=flush_cache)
        return self._run(self.tokenizer_manager.update_weights_from_tensor(obj))

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str = "weight_update_group",
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        """Upstream's: join a trainer's process group (the trainer is rank 0, this server `rank_offset`),
        over which `update_weights_from_distributed` receives weights; (success, message). Waits while
        the trainer joins (`sglang.srt.utils.init_custom_process_group` on its side)."""
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}  # fmt: skip
        obj = parse_init_weights_update_group(body)
        return self._run(self.tokenizer_manager.init_weights_update_group(obj))

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[Any],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        weight_version: str | None = None,
    ) -> tuple[bool, str]:
        """Upstream's: receive one tensor per checkpoint name from the trainer's broadcast (rank 0 of
        `group_name`, in this order; `dtypes` as torch dtypes or their names) and write them into the
        weights in place; (success, message)."""
        body = {"names": list(names), "dtypes": [str(d) for d in dtypes], "shapes": [list(s) for s in shapes]}
        body.update(group_name=group_name, flush_cache=flush_cache, weight_version=weight_version)
        obj = parse_update_weights_from_distributed(body)
        return self._run(self.tokenizer_manager.update_weights_from_distributed(obj))

    def destroy_weights_update_group(self, group_name: str = "weight_update_group") -> tuple[bool, str]:
        obj = parse_destroy_weights_update_group({"group_name": group_name})
        return self._run(self.tokenizer_manager.destroy_weights_update_group(obj))

    def get_weights_by_name(self, name: str, truncate_size: int = 100) -> list:
        """Upstream's: the first `truncate_size` rows of parameter `name` (this server's names and
        layout, as `named_parameters` gives them), as float lists; RequestError for a name it lacks."""
        obj = parse_get_weights_by_name({"name": name, "truncate_size": truncate_size})
        return self._run(self.tokenizer_manager.get_weights_by_name(obj))

    def load_lora_adapter(self, lora_name: str, lora_path: str, pinned: bool = False) -> dict:
        """Upstream's: serve the adapter at `lora_path` as `lora_name`; {success, error_message,
        loaded_adapters}."""
        obj = parse_load_lora_adapter({"lora_name": lora_name, "lora_path": lora_path, "pinned": pinned})
        return dict(zip(LORA_REPLY, self._run(self.tokenizer_manager.load_lora_adapter(obj)), strict=True))

    def unload_lora_adapter(self, lora_name: str) -> dict:
        obj = parse_unload_lora_adapter({"lora_name": lora_name})
        return dict(zip(LORA_REPLY, self._run(self.tokenizer_manager.unload_lora_adapter(obj)), strict=True))

    def release_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        """Upstream's: free the memory of `tags` ("weights", "kv_cache", "cuda_graph"; None: all) with
        nothing running, until `resume_memory_occupation` (needs --enable-memory-saver); (success,
        message). Requests sent meanwhile wait."""
        obj = parse_memory_occupation({"tags": tags}, ReleaseMemoryOccupationReqInput)
        return self._run(self.tokenizer_manager.release_memory_occupation(obj))

    def resume_memory_occupation(self, tags: list[str] | None = None) -> tuple[bool, str]:
        obj = parse_memory_occupation({"tags": tags}, ResumeMemoryOccupationReqInput)
        return self._run(self.tokenizer_manager.resume_memory_occupation(obj))

    def start_expert_distribution_record(self) -> ExpertDistributionReqOutput:
        """Upstream's (--expert-distribution-recorder-mode): clear the record and record."""
        return self._run(self.tokenizer_manager.expert_distribution("start"))

    def stop_expert_distribution_record(self) -> ExpertDistributionReqOutput:
        return self._run(self.tokenizer_manager.expert_distribution("stop"))

    def dump_expert_distribution_record(self) -> ExpertDistributionReqOutput:
        """Write the record (`message`: the file) and clear it."""
        return self._run(self.tokenizer_manager.expert_distribution("dump"))

    def freeze_gc(self) -> None:
        """Upstream's: after a warm-up, freeze the collector in every process (`TokenizerManager.freeze_gc`)."""
        self._run(self.tokenizer_manager.freeze_gc())

    def start_profile(self, **kwargs: Any) -> ProfileReqOutput:
        """Upstream's: start the scheduler's torch profiler; `kwargs`: /start_profile's fields
        (`profile_request.py`; a wrong one raises RequestError naming it)."""
        args = self.server_args
        req = parse_profile_request(kwargs, args.device == "cuda", args.tp_size * args.dp_size)
        return self._run(self.tokenizer_manager.start_profile(req))

    def stop_profile(self) -> ProfileReqOutput:
        """Stop it once the traces are written (`message` names this rank 0's)."""
        return self._run(self.tokenizer_manager.stop_profile())

    def get_internal_state(self) -> dict[str, Any]:
        return self._run(self.tokenizer_manager.get_internal_state())

    def get_server_info(self) -> dict[str, Any]:
        """Server args, the scheduler's limits, and its live pool and slot statistics."""
        state = self.get_internal_state()
        return build_server_info(self.server_args, self._launched.model_info, state, self.tokenizer_manager)

    def shutdown(self) -> None:
        """Stop the subprocesses and the loop thread. Idempotent; also runs at interpreter exit."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        if self._loop is not None and self._loop.is_running():
            tm = getattr(self, "tokenizer_manager", None)
            if tm is not None:
                asyncio.run_coroutine_threadsafe(tm.close(), self._loop).result(5)
            asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), self._loop).result(5)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._launched.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- loop bridging -----------------------------------------------------------------------------

    def _run(self, coro: Coroutine) -> Any:
        if self._closed:
            coro.close()
            raise RuntimeError("This Engine has been shut down.")
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()
        except concurrent.futures.CancelledError:
            if self._closed:  # `shutdown` on another thread ended the call
                raise RuntimeError("This Engine was shut down while the call ran.") from None
            raise

    async def _await(self, coro: Coroutine) -> Any:
        if self._closed:
            coro.close()
            raise RuntimeError("This Engine has been shut down.")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if self._closed and not _current_task_cancelling():
                raise RuntimeError("This Engine was shut down while the call ran.") from None
            raise


async def _cancel_other_tasks() -> None:
    """On shutdown: end every call still running on the engine's loop (a generate on another thread
    waits for its future, which a stopped loop never completes), and let each finish its cleanup."""
    others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for task in others:
        task.cancel()
    if others:
        await asyncio.wait(others, timeout=2)


def _current_task_cancelling() -> bool:
    """Whether the caller's own task was cancelled (Python 3.11+ tells; 3.10 cannot, and says no)."""
    task = asyncio.current_task()
    return task is not None and getattr(task, "cancelling", lambda: 0)() > 0


async def _call(fn: Any, *args: Any) -> Any:
    return fn(*args)  # (on the loop that owns the TokenizerManager: nothing of it is thread-safe)


async def _first(agen: AsyncIterator[Any]) -> Any:
    async for item in agen:
        await agen.aclose()
        return item
    raise RuntimeError("generate_request produced no output")


def _make_obj(
    prompt: Any,
    sampling_params: Any,
    input_ids: Any,
    return_logprob: Any,
    logprob_start_len: Any,
    top_logprobs_num: Any,
    stream: bool,
    rid: Any,
    return_text_in_logprobs: bool,
    token_ids_logprob: Any = None,
    return_hidden_states: Any = False,
    extra_key: Any = None,
    cache_salt: Any = None,
    image_data: Any = None,
    video_data: Any = None,
    priority: Any = None,
    lora_path: Any = None,
    return_routed_experts: Any = False,
    session_params: Any = None,
    require_reasoning: Any = False,
    max_thinking_tokens: Any = None,
) -> GenerateReqInput:
    return GenerateReqInput(
        text=prompt,
        input_ids=input_ids,
        sampling_params=sampling_params,
        rid=rid,
        return_logprob=return_logprob,
        logprob_start_len=-1 if logprob_start_len is None else logprob_start_len,
        top_logprobs_num=0 if top_logprobs_num is None else top_logprobs_num,
        return_text_in_logprobs=return_text_in_logprobs,
        token_ids_logprob=token_ids_logprob,
        stream=stream,
        return_hidden_states=return_hidden_states,
        extra_key=extra_key,
        cache_salt=cache_salt,
        image_data=image_data,
        video_data=video_data,
        priority=priority,
        lora_path=lora_path,
        return_routed_experts=return_routed_experts,
        session_params=session_params,
        require_reasoning=require_reasoning,
        max_thinking_tokens=max_thinking_tokens,
    )
