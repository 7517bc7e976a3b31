"""TokenizerManager: the front of the runtime, in the HTTP (or Engine) process, on one asyncio loop.

It tokenizes and validates requests (`request_validation`), sends them to the scheduler, receives the
detokenizer's `BatchStrOut` deltas in a background task, accumulates each request's state and hands
outputs to the caller, in SGLang's native format (`{"text", "output_ids", "meta_info"}`; without
"text" under --skip-tokenizer-init, where prompts must be input_ids). A caller that goes away
(cancellation, a closed stream, a disconnected HTTP client) aborts its requests; a request the server
ends (a deadline) raises `ServerAbortError` with the HTTP status for the client. Long texts are
tokenized off the loop (`TextEncoder`). Control RPCs (flush cache, internal state, pause and continue;
the weight and memory calls of `TokenizerCommunicatorMixin`) go to the scheduler, whose replies come
back on the same socket.

A child process that has exited, or a scheduler silent for longer than --watchdog-timeout
(`BackendHealth`), fails waiting requests with `BackendDeadError` (HTTP 503).

All methods run on the loop that called `start()`; nothing here is thread-safe.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import zmq
import zmq.asyncio

from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.lora.lora_registry import LoRARegistry
from sglang.srt.managers.backend_health import BackendDeadError, BackendHealth
from sglang.srt.managers.decode_tokenizer import send_decoder_spec
from sglang.srt.managers.io_struct import (
    AbortReq,
    BatchStrOut,
    BatchTokenizedGenerateReqInput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    PortArgs,
    SchedulerHeartbeat,
)
from sglang.srt.managers.request_log import observers
from sglang.srt.managers.request_validation import (
    TEXT_WITHOUT_TOKENIZER,
    NormalizedRequest,
    RequestError,
    RequestLimits,
    auto_truncated,
    build_requests,
    check_input_len,
    hidden_states_refused,
    max_samples_per_request,
    parse_prompts,
)
from sglang.srt.managers.session_controller import SessionController
from sglang.srt.managers.text_encoder import TextEncoder
from sglang.srt.managers.tokenizer_communicator_mixin import (
    CONTROL_TIMEOUT_S,
    DisconnectCheck,
    TokenizerCommunicatorMixin,
)
from sglang.srt.managers.tokenizer_output import ReqState
from sglang.srt.multimodal.media_io import MediaPolicy, MediaReader, RequestReads
from sglang.srt.multimodal.media_pool import MediaCancelled, MediaJob
from sglang.srt.multimodal.processor import ImageInputProcessor, attach_media, per_prompt
from sglang.srt.server_args_frontend import read_chat_template
from sglang.srt.utils.gc_watch import watch_gc
from sglang.srt.utils.hf_transformers_utils import get_tokenizer

logger = logging.getLogger(__name__)

# How often a waiting request checks whether its HTTP client is still there.
DISCONNECT_POLL_S = 1.0


class ClientDisconnected(Exception):
    """The HTTP client went away while its request was waiting; the request has been aborted."""


class ServerAbortError(Exception):
    """The server ended the request (e.g. a deadline); the client gets `status_code` and `message`."""

    def __init__(self, status_code: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param  # the request's field at fault, for a 4xx


class TokenizerManager(TokenizerCommunicatorMixin):
    def __init__(
        self,
        server_args: Any,
        port_args: PortArgs,
        model_info: dict[str, Any],
        backend_failure: Callable[[], str | None] | None = None,
        tokenizer: Any = None,
    ):
        self.server_args = server_args
        # Checked while requests wait, so that a dead or stalled backend fails them instead of hanging
        # them. `backend_failure` says why the child processes cannot serve (one has exited), or None.
        self.health = BackendHealth(server_args.watchdog_seconds, backend_failure or (lambda: None))
        self.port_args = port_args
        # --skip-tokenizer-init (upstream's): no tokenizer at all; prompts come as input_ids, and
        # replies carry output_ids without "text".
        self.tokenizer: Any = None
        self.encoder: TextEncoder | None = None
        if not server_args.skip_tokenizer_init:
            self.tokenizer = tokenizer if tokenizer is not None else get_tokenizer(server_args.tokenizer_path)
            if server_args.chat_template is not None:  # (checked at start: `server_args_frontend`)
                self.tokenizer.chat_template = read_chat_template(server_args.chat_template)
            self.encoder = TextEncoder(self.tokenizer, server_args.tokenizer_path)
        self.lora = LoRARegistry(server_args)  # the adapters requests may name (--enable-lora)
        self.limits = RequestLimits(
            context_len=model_info["context_len"],
            max_req_input_len=model_info["max_req_input_len"],
            vocab_size=model_info["vocab_size"],
            hidden_states_refused=hidden_states_refused(server_args),
            custom_logit_processor_enabled=server_args.enable_custom_logit_processor,
            without_tokenizer=self.encoder is None,
            max_logprobs=server_args.max_logprobs,
            max_logprob_entries=server_args.max_logprob_entries_per_request,
            hidden_size=server_args.model_config.arch.hf_config.hidden_size
            if server_args.enable_return_hidden_states else 0,  # fmt: skip
            routed_experts_enabled=server_args.enable_return_routed_experts,
            max_hidden_state_floats=server_args.max_hidden_state_floats_per_request,
            preferred_sampling_params=server_args.preferred_sampling_params,
            auto_truncate=server_args.allow_auto_truncate,
            reasoning_parser=server_args.reasoning_parser is not None and self.encoder is not None,
            strict_thinking=server_args.enable_strict_thinking,
            lora=self.lora,
        )
        # The model's image processor (None: a text-only model).
        self.image_processor = ImageInputProcessor.create(
            resolve_model_path(server_args.model_path), server_args
        )
        # What requests' media items may make this server read (multimodal/media_io.py).
        self.media = MediaReader(MediaPolicy.from_server_args(server_args))
        self.max_samples_per_request = max_samples_per_request(
            server_args.max_samples_per_request, model_info["max_running_requests"]
        )
        # Cleared by /pause_generation: new requests wait until /continue_generation.
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._scheduler_paused = False  # a "retract" or "in_place" pause reached the scheduler
        # Cleared while /release_memory_occupation has memory released: new requests wait for the resume.
        self._memory_resumed = asyncio.Event()
        self._memory_resumed.set()
        self._memory_lock = asyncio.Lock()
        self.rid_to_state: dict[str, ReqState] = {}
        # /open_session, /close_session and the requests' session_params (session_controller.py).
        refusal = "Sessions are not supported with --disaggregation-mode."
        refusal = None if server_args.disaggregation_mode == "null" else refusal
        bos = getattr(self.tokenizer, "bos_token_id", None)
        self.sessions = SessionController(refusal, bos, server_args.dp_size)
        # `request_log.Observers` (metrics, --log-requests): the requests' arrival, tokens, finish, abort.
        self.observer: Any = observers(server_args)
        watch_gc(server_args.gc_warning_threshold_secs)  # (this process's; the children's: `configure_subprocess`)
        self._token_text: dict[int, str] = {}
        self._control_waiters: dict[type, asyncio.Future] = {}
        self._weight_update_lock = asyncio.Lock()
        # Cleared while a weight update waits for the running requests: new ones wait (as paused).
        self._no_update_hold = asyncio.Event()
        self._no_update_hold.set()
        self._control_locks: dict[type, asyncio.Lock] = {}
        self._recv_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self._ctx: zmq.asyncio.Context | None = None

    # ---- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Open the sockets and start receiving, on the running loop (idempotent)."""
        if self._recv_task is not None:
            return
        self._ctx = zmq.asyncio.Context()
        self._recv = self._send = self._to_detokenizer = None
        try:
            self._recv = self._ctx.socket(zmq.PULL)
            self._recv.bind(self.port_args.tokenizer_ipc_name)
            # A plain (blocking) socket with no high-water mark: sends never wait (safe in `finally` blocks)
            self._send = zmq.Context.instance().socket(zmq.PUSH)
            self._send.setsockopt(zmq.SNDHWM, 0)
            self._send.connect(self.port_args.scheduler_input_ipc_name)
            # What the detokenizer decodes with (`decode_tokenizer.py`).
            self._to_detokenizer = send_decoder_spec(self.tokenizer, self.port_args.detokenizer_ipc_name)
        except BaseException:
            self._close_sockets()
            raise
        self._recv_task = asyncio.create_task(self._recv_loop())
        self._watch_task = asyncio.create_task(self.health.watch())

    def _close_sockets(self) -> None:
        for sock in (self._recv, self._send, self._to_detokenizer):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        self._ctx = None

    async def close(self) -> None:
        if self.encoder is not None:
            self.encoder.close()
        self.media.close()
        if self._watch_task is not None:
            self._watch_task.cancel()
            self._watch_task = None
        if self._recv_task is not None:
            self._recv_task.cancel()
            self._recv_task = None
            self._close_sockets()

    # ---- generation --------------------------------------------------------------------------------

    async def encode(self, text: str, param: str, add_special_tokens: bool = True, truncate: bool = False) -> list[int]:
        """The ids of `text`, tokenized off the loop when long; RequestError naming `param` when it is
        longer than the context (`truncate`, with --allow-auto-truncate: cut to the limit instead)."""
        if self.encoder is None:
            raise RequestError(TEXT_WITHOUT_TOKENIZER, param)
        truncate = truncate and self.limits.auto_truncate
        enc = await self.encoder.encode(text, self.limits.context_len, add_special_tokens, truncate)
        if truncate and enc.ids is not None:
            return auto_truncated(enc.ids, self.limits, param, enc.num_tokens)
        if enc.ids is None:
            check_input_len(enc.num_tokens, self.limits, param, enc.at_least)  # raises: too long
        assert enc.ids is not None
        return enc.ids

    async def normalize(
        self, obj: GenerateReqInput, trusted: bool = False, request: DisconnectCheck | None = None
    ) -> tuple[list[NormalizedRequest], bool]:
        prompts = parse_prompts(obj, self.max_samples_per_request)
        if self.encoder is None:
            if prompts.texts:
                raise RequestError(TEXT_WITHOUT_TOKENIZER, "text")
            encoded = []
        else:
            truncate = self.limits.auto_truncate and obj.image_data is None and obj.video_data is None
            encoded = await self.encoder.encode_many(prompts.texts, self.limits.context_len, truncate=truncate)
        sessions = None
        if obj.session_params:  # (each prompt's history goes before it: checked as its input)
            media = obj.image_data is not None or obj.video_data is not None
            sessions = self.sessions.build_prompts(obj.session_params, prompts, encoded, media, self.limits)
        items, is_list = build_requests(obj, prompts, encoded, self.limits)
        for item in items if sessions is not None else ():
            item.session = copy.copy(sessions[item.prompt])  # (each sample is a turn of its own)
        media = {"image_data": obj.image_data, "video_data": obj.video_data}
        p = self.image_processor
        # The request's media work: one item at a time in the media pool, dropped once `request` is gone.
        job = MediaJob(request)
        try:
            if p is not None and p.refusal is None:
                # Every media item as bytes, within the media flags' bounds, before the processor sees it
                # (the batch's shape first: nothing is read for a request refused anyway).
                num_prompts = max(item.prompt for item in items) + 1
                shared = RequestReads(job)  # the request's bytes and fetch slots, over both fields
                for field in ("image_data", "video_data") if p.video_refusal is None else ("image_data",):
                    per_prompt(media[field], num_prompts, prompts.is_batch, field)
                    data = media[field]
                    media[field] = await self.media.read(data, field, prompts.is_batch, trusted, shared)
            await attach_media(p, items, *media.values(), self.limits, prompts.is_batch, job)
        except MediaCancelled:
            raise ClientDisconnected() from None
        return items, is_list

    async def generate_request(
        self,
        obj: GenerateReqInput,
        request: DisconnectCheck | None = None,
        trusted: bool = False,
        warmup: bool = False,
    ) -> AsyncIterator[Any]:
        """Yield the reply: once (a dict, or a list for batches and n > 1) without streaming; with
        streaming, chunks as tokens arrive (cumulative text, as SGLang streams; "index" set when the
        request has several outputs). Raises RequestError before anything is sent, ServerAbortError
        when the server ends a request. `trusted`: an in-process caller (Engine), whose media items
        may name any local file; HTTP routes leave it False (docs/multimodal.md). `warmup`: the server's
        own request, its warm-up or /health_generate (`TokenizedGenerateReqInput.warmup`; not logged)."""
        items, is_list = await self.normalize(obj, trusted, request)
        for item in items:
            item.req.warmup = warmup
        # Held while paused, while a weight update waits for the running requests to finish, and while
        # memory is released (the model cannot run).
        gates = (self._unpaused, self._no_update_hold, self._memory_resumed)
        while not all(g.is_set() for g in gates):
            held = next(g for g in gates if not g.is_set())
            await self._wait_event(held, request, clear=False)
        error = self.health.error()
        if error is not None:
            raise BackendDeadError(error)
        # Checked here, after the gates and with no await before the registration below: two requests
        # with one rid that both waited at a gate must not both pass.
        for item in items:
            if item.req.rid in self.rid_to_state:
                raise RequestError(f"A request with rid {item.req.rid!r} is already running.", "rid")
        yield_event = asyncio.Event()
        states: list[ReqState] = []
        try:
            replaced = self.sessions.begin(items) if any(i.session is not None for i in items) else ()
            for item in items:
                state = ReqState(item, time.time(), yield_event, obj.log_metrics)
                self.rid_to_state[item.req.rid] = state
                states.append(state)
            if self.observer is not None:
                self.observer.on_arrival(states)
            for rid in replaced:  # (running turns a session's replace forgot)
                self.abort_request(rid)
            # A batch goes in one message, so the scheduler admits it together.
            reqs = [item.req for item in items]
            self._send.send_pyobj(reqs[0] if len(reqs) == 1 else BatchTokenizedGenerateReqInput(reqs))
            if obj.stream:
                async for chunk in self._stream(states, yield_event, request, is_list):
                    yield chunk
            else:
                await self._wait_all(states, yield_event, request)
                for state in states:
                    _raise_if_server_abort(state)
                outs = [await self.make_output(s) for s in states]
                yield outs if is_list else outs[0]
        finally:
            for state in states:
                self.sessions.end(state.item.session, state.output_ids)
                if not state.finished:
                    self.abort_request(state.rid)
                    if self.observer is not None:
                        self.observer.on_abort(state)
                self.rid_to_state.pop(state.rid, None)

    async def _wait_event(
        self, event: asyncio.Event, request: DisconnectCheck | None, clear: bool = True
    ) -> None:
        """Wait for `event` (cleared after, unless `clear` is False), failing when the client goes away
        or the backend dies or stalls."""
        while True:
            try:
                await asyncio.wait_for(event.wait(), DISCONNECT_POLL_S)
                if clear:
                    event.clear()
                return
            except asyncio.TimeoutError:
                if request is not None and await request.is_disconnected():
                    # The caller's `finally` aborts whatever is still running.
                    raise ClientDisconnected() from None
                error = self.health.error()
                if error is not None:
                    raise BackendDeadError(error) from None

    async def _wait_all(self, states: list[ReqState], event: asyncio.Event, request: Any) -> None:
        while not all(s.finished for s in states):
            await self._wait_event(event, request)

    async def _stream(
        self, states: list[ReqState], event: asyncio.Event, request: Any, with_index: bool
    ) -> AsyncIterator[dict[str, Any]]:
        while True:
            for state in states:
                _raise_if_server_abort(state)
                if state.has_unsent_update():
                    chunk = await self.make_output(state)
                    state.mark_sent()
                    if with_index:
                        chunk["index"] = state.index
                    yield chunk
            # Outputs that arrived while the caller held a chunk are sent before anything ends.
            if any(s.has_unsent_update() for s in states):
                continue
            if all(s.finished for s in states):
                return
            await self._wait_event(event, request)

    async def make_output(self, state: ReqState) -> dict[str, Any]:
        out = await state.reply(self.token_texts)
        out["meta_info"]["weight_version"] = self.server_args.weight_version
        if self.tokenizer is None:
            del out["text"]  # upstream's reply without a tokenizer: output_ids and meta_info
        if state.item.return_prompt_token_ids:  # (every chunk of a stream too, as upstream's)
            out["prompt_token_ids"] = state.item.req.input_ids  # (not changed once sent: no copy per chunk)
        return out

    def token_texts(self, ids: list[int]) -> list[str]:
        missing = [t for t in set(ids) if t not in self._token_text]
        if missing:
            for t, s in zip(missing, self.tokenizer.batch_decode([[t] for t in missing]), strict=True):
                self._token_text[t] = s
        return [self._token_text[t] for t in ids]

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """Ask the scheduler to abort; it answers with each request's final (abort) message."""
        if self._recv_task is None:
            return
        self._send.send_pyobj(AbortReq(rid=rid, abort_all=abort_all))

    # ---- receiving ---------------------------------------------------------------------------------

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._recv.recv_pyobj()
            try:
                self._dispatch(msg)
            except Exception:
                # A malformed message must not kill the loop every request depends on.
                logger.exception("Failed to handle a %s message", type(msg).__name__)

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, BatchStrOut):
            self._handle_batch_output(msg)
            return
        self.health.heard()  # everything else comes from the scheduler
        if isinstance(msg, SchedulerHeartbeat):
            return
        fut = self._control_waiters.pop(type(msg), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        else:
            logger.warning("Dropping an unexpected or late %s", type(msg).__name__)

    def _handle_batch_output(self, out: BatchStrOut) -> None:
        for i, rid in enumerate(out.rids):
            state = self.rid_to_state.get(rid)
            if state is None:  # its caller is gone (aborted) or it belongs to nobody
                continue
            first = state.apply(out, i)
            if state.finished:  # (a session's next turn may continue it now, before its call returns)
                self.sessions.end(state.item.session, state.output_ids)
            if self.observer is not None:
                self.observer.on_message(state, first, len(out.output_ids[i]))
            state.event.set()

    # ---- control -----------------------------------------------------------------------------------

    async def flush_cache(
        self, timeout: float = CONTROL_TIMEOUT_S, end_of_warmup: bool = False
    ) -> FlushCacheReqOutput:
        return await self._control(FlushCacheReqInput(end_of_warmup), FlushCacheReqOutput, timeout)

    async def get_internal_state(self, timeout: float = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        out = await self._control(GetInternalStateReq(), GetInternalStateReqOutput, timeout)
        return out.internal_state

    def _all_finished(self) -> bool:
        return all(s.finished for s in self.rid_to_state.values())

    async def _wait_until(
        self, done: Callable[[], bool], request: DisconnectCheck | None, timeout: float | None = None
    ) -> bool:
        """Poll `done` every 20 ms: True once it holds, False after `timeout` seconds (None: no limit);
        ClientDisconnected or BackendDeadError as `_wait_event` raises them."""
        last_check = time.monotonic()
        deadline = None if timeout is None else last_check + timeout
        while not done():
            if deadline is not None and time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.02)
            error = self.health.error()
            if error is not None:
                raise BackendDeadError(error)
            if request is not None and time.monotonic() - last_check >= DISCONNECT_POLL_S:
                last_check = time.monotonic()
                if await request.is_disconnected():
                    raise ClientDisconnected()
        return True

    async def _control(self, req: Any, reply_type: type, timeout: float | None) -> Any:
        """Send a control request and wait for its reply: TimeoutError after `timeout` (None: no limit),
        BackendDeadError when the backend dies or stalls meanwhile."""
        # One RPC of a kind at a time: replies carry no id, so a reply belongs to the one waiter.
        lock = self._control_locks.setdefault(reply_type, asyncio.Lock())
        async with lock:
            fut = asyncio.get_running_loop().create_future()
            self._control_waiters[reply_type] = fut
            self._send.send_pyobj(req)
            deadline = None if timeout is None else time.monotonic() + timeout
            try:
                while True:
                    left = DISCONNECT_POLL_S if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        name = type(req).__name__
                        raise TimeoutError(f"The scheduler did not answer {name} in {timeout:.0f} s.")
                    try:
                        return await asyncio.wait_for(asyncio.shield(fut), min(left, DISCONNECT_POLL_S))
                    except asyncio.TimeoutError:
                        error = self.health.error()
                        if error is not None:
                            raise BackendDeadError(error) from None
            finally:
                self._control_waiters.pop(reply_type, None)


def _raise_if_server_abort(state: ReqState) -> None:
    reason = state.finished_reason or {}
    if reason.get("type") == "abort" and reason.get("status_code"):
        raise ServerAbortError(
            reason["status_code"],
            reason.get("message", "The server aborted the request."),
            reason.get("param"),
        )
