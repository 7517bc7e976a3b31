"""What the OpenAI-compatible and native routes share: SSE framing and the request flow.

Errors are raised and answered by `http_errors` (its bodies are also a stream's error events).
Streams are Server-Sent Events: `data: <json>\\n\\n` per chunk, then `data: [DONE]\\n\\n`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from sglang.srt.constrained.grammar_spec import GRAMMAR_FIELDS
from sglang.srt.entrypoints.http_errors import (
    backend_dead_body,
    internal_error_body,
    json_object,
    json_response,
    server_abort_body,
)
from sglang.srt.entrypoints.openai.protocol import UsageInfo, request_error_from_validation
from sglang.srt.entrypoints.stream_keepalive import SSE_COMMENT, Keepalive
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import (
    BackendDeadError,
    ClientDisconnected,
    ServerAbortError,
    TokenizerManager,
)
from sglang.srt.managers.tokenizer_output import StreamMerger, built_off_loop_if_large, reply_entries

logger = logging.getLogger(__name__)

SSE_DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    if isinstance(obj, BaseModel):
        obj = obj.model_dump()
    return b"data: " + orjson.dumps(obj) + b"\n\n"


class SSEResponse(StreamingResponse):
    """A stream whose generator is always closed when the response ends, however it ends (finished,
    client gone, server error): closing it aborts requests still running."""

    media_type = "text/event-stream"

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


async def start_generation(
    tm: TokenizerManager, obj: GenerateReqInput, request: Request | None
) -> tuple[Any, AsyncIterator[Any]]:
    """Validate and send `obj`; return the first output and the generator for the rest. Validation
    errors (RequestError) are raised here, before any response has started."""
    gen = tm.generate_request(obj, request)
    try:
        first = await gen.__anext__()
    except BaseException:
        await gen.aclose()
        raise
    return first, gen


async def sse_stream(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """Frame a stream of SSE events: errors become an error event, and [DONE] always ends it."""
    try:
        async for event in events:
            yield event
    except ClientDisconnected:
        return  # nobody to tell; the request was aborted on the way out
    except ServerAbortError as e:
        yield sse(server_abort_body(e))
    except BackendDeadError as e:
        yield sse(backend_dead_body(e))
    except Exception as e:
        logger.exception("Streaming failed")
        yield sse(internal_error_body(e))
    yield SSE_DONE


def reword(message: str, names: dict[str, str], indexed: bool = False) -> str:
    """`message` with each whole word of `names` (another API's field names) replaced by its value;
    `indexed`: a word's `[n]` goes with it (the position in a joined prompt names nothing here)."""
    for old, new in names.items():
        index = r"(\[\d+\])?" if indexed else ""
        message = re.sub(rf"(?<![\w.]){re.escape(old)}\b{index}", new, message)
    return message


def parse_json_model(model: type[BaseModel], body: bytes) -> Any:
    """A request body as `model`, parsed by orjson first (an integer past 64 bits becomes a float, which a
    count field refuses and an echoed field writes back, where pydantic's own parser keeps an int no
    reply can carry): the routes that echo what a client sent."""
    try:
        return model.model_validate(json_object(body))
    except ValidationError as e:
        raise request_error_from_validation(e) from None


def parse_model(model: type[BaseModel], body: bytes) -> Any:
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise request_error_from_validation(e) from None


class OpenAIServingBase:
    """One OpenAI route: parse, map to a native request, reply (JSON or SSE)."""

    request_model: type[BaseModel]
    # Native field name -> this API's name, for error messages raised by the shared validation.
    param_names: dict[str, str] = {}

    def __init__(self, tokenizer_manager: TokenizerManager, model_name: str, include_usage: bool = False):
        """`include_usage`: --stream-response-default-include-usage (every stream ends with its usage)."""
        self.tm = tokenizer_manager
        self.model_name = model_name
        self.include_usage = include_usage

    async def handle(self, request: Request) -> Response:
        """The route's reply; errors are raised in this API's field names (`http_errors` answers them)."""
        if self.tm.tokenizer is None:
            raise self.tokenizer_needed(request.url.path)
        req = parse_model(self.request_model, await request.body())
        obj = await self.to_generate_input(req)
        obj.lora_path = self.adapter_of(req)
        try:
            first, gen = await start_generation(self.tm, obj, request)
        except RequestError as e:
            raise self.rename(e, req) from None
        except ServerAbortError as e:
            raise self.rename_abort(req, e) from None
        if getattr(req, "stream", False):
            return SSEResponse(sse_stream(self.stream_events(req, obj, first, gen)))
        await gen.aclose()
        # A reply with many logprobs (a long answer, an echoed prompt) is built off the event loop.
        # (token-in token-out ids count as entries too: a long prompt's ids in each of n choices)
        outs = as_list(first)
        entries = sum(reply_entries(out["meta_info"]) + len(out.get("prompt_token_ids", ())) for out in outs)
        return await built_off_loop_if_large(entries, self._json_reply, req, obj, first)

    def _json_reply(self, req: Any, obj: GenerateReqInput, first: Any) -> Response:
        return json_response(self.build_response(req, obj, first))

    def tokenizer_needed(self, route: str) -> RequestError:
        """The refusal of every request to an OpenAI route under --skip-tokenizer-init: its prompts and
        replies are text (upstream fails them with a 500 or 400 of its own)."""
        prompt = self.param_names.get("input_ids", "prompt")
        return RequestError(
            f"{route} needs a tokenizer for its {prompt} and text replies, and this server was started "
            "with --skip-tokenizer-init; send token ids to /generate (input_ids) instead.",
            prompt,
        )

    def rename(self, err: RequestError, req: Any = None) -> RequestError:
        """A native validation error in this API's words: its field, and the native field names in its
        message (only those: an English word that happens to be a native name stays). A chat request that
        sent `input_ids` itself (upstream's pretokenized prompt) keeps that name."""
        names = self.param_names
        if getattr(req, "input_ids", None) is not None:
            names = {k: v for k, v in names.items() if k != "input_ids"}
        param = err.param or ""
        new = names.get(param) or param.removeprefix("sampling_params.") or None
        message = err.message
        for native, public in names.items():
            word = re.escape(native.removeprefix("sampling_params."))
            message = re.sub(rf"\b{word}\b", public, message)
        return RequestError(message, new, err.code)

    @staticmethod
    def hidden_states_field(req: Any, meta: dict) -> dict[str, Any]:
        """A choice's `hidden_states` where the request asked (upstream's: the last position's, [] with
        only the prompt's), as an extra field; else nothing."""
        if not getattr(req, "return_hidden_states", False):
            return {}
        states = meta.get("hidden_states") or []
        return {"hidden_states": states[-1] if len(states) > 1 else []}

    @staticmethod
    def rename_abort(req: Any, e: ServerAbortError) -> ServerAbortError:
        """A grammar the scheduler could not compile, named by the field of this API it came from
        (`response_format`, `tools`, `regex`, ...): the scheduler knows the native field only."""
        origin = getattr(req, "grammar_origin", None)
        if origin is None or e.param not in GRAMMAR_FIELDS or e.param == origin:
            return e
        return ServerAbortError(e.status_code, f"{origin}: {e.message}", origin)

    async def to_generate_input(self, req: Any) -> GenerateReqInput:
        raise NotImplementedError

    def adapter_of(self, req: Any) -> str | None:
        """The LoRA adapter a request names (upstream's rule): its `model` as "base:adapter" (or an
        adapter's name), else its `lora_path`; None: the base model."""
        _, adapter = self.tm.lora.split_model(req.model)
        if adapter == "":
            raise RequestError(f"model {req.model!r} names no adapter after ':'.", "model")
        if adapter is None:
            return req.lora_path
        if req.lora_path is not None and req.lora_path != adapter:
            logger.info("The request's model names adapter %r; its lora_path %r is ignored.", adapter, req.lora_path)
        return adapter

    # ---- replies: one implementation, the route supplies its choices --------------------------------

    id_prefix: str  # "chatcmpl-" or "cmpl-"
    response_model: type[BaseModel]
    stream_response_model: type[BaseModel]

    def make_choice(self, req: Any, index: int, out: dict) -> BaseModel:
        """The choice of a whole (non-streamed) output."""
        raise NotImplementedError

    def opening_choice(self, index: int) -> BaseModel | None:
        """A choice to send before a stream's first delta of choice `index` (chat: the role)."""
        return None

    def stream_choice(self, req: Any, index: int, delta: str, meta: dict, progress: dict) -> BaseModel | None:
        """The choice for one stream chunk, or None if it carries nothing. `progress` is the route's
        own per-choice state across chunks (how many logprob entries it sent)."""
        raise NotImplementedError

    def stream_choices(self, req: Any, index: int, delta: str, meta: dict, progress: dict) -> list[BaseModel]:
        """The events' choices for one chunk of the output (`stream_choice`'s, by default)."""
        choice = self.stream_choice(req, index, delta, meta, progress)
        choices = [] if choice is None else [choice]
        return choices + self.hidden_states_choices(req, index, meta, choices)

    def hidden_states_choices(self, req: Any, index: int, meta: dict, choices: list) -> list[BaseModel]:
        """Upstream's: after a choice's finishing chunk, one more with its `hidden_states` (no finish
        reason), where the request asked."""
        if not choices or choices[-1].finish_reason is None:
            return []
        field = self.hidden_states_field(req, meta)
        return [self.hidden_states_choice(index, field["hidden_states"])] if field else []

    def hidden_states_choice(self, index: int, states: list) -> BaseModel:
        raise NotImplementedError

    def response_model_name(self, req: Any) -> str:
        """The `model` of a reply: the request's, as upstream echoes it, else the served model's name."""
        return req.model or self.model_name

    def build_response(self, req: Any, obj: GenerateReqInput, first: Any) -> BaseModel:
        outs = as_list(first)
        return self.response_model(
            id=f"{self.id_prefix}{outs[0]['meta_info']['id']}",
            model=self.response_model_name(req),
            choices=[self.make_choice(req, i, out) for i, out in enumerate(outs)],
            usage=UsageInfo(**usage(outs, req.n)),
        )

    def _chunk_events(
        self, req: Any, index: int, delta: str, meta: dict, progress: dict, event: Callable[..., bytes]
    ) -> list[bytes]:
        return [event([choice]) for choice in self.stream_choices(req, index, delta, meta, progress)]

    async def stream_events(
        self, req: Any, obj: GenerateReqInput, first: Any, gen: AsyncIterator[Any]
    ) -> AsyncIterator[bytes]:
        """Chunks carry each choice's whole text so far; events carry the new part. With
        `stream_options.include_usage` (or --stream-response-default-include-usage) a last event has no
        choices and the usage."""
        stream_id = f"{self.id_prefix}{first['meta_info']['id']}"
        model = self.response_model_name(req)
        sent_text: dict[int, int] = {}
        progress: dict[int, Any] = {}
        last: dict[int, dict] = {}
        # Chunks carry only their new logprobs and hidden states; the choices read whole lists.
        merged: dict[int, StreamMerger] = {}

        def event(choices: list[BaseModel], **extra: Any) -> bytes:
            return sse(self.stream_response_model(id=stream_id, model=model, choices=choices, **extra))

        chunk = first
        keepalive = Keepalive(SSE_COMMENT)  # (a tool call is sent when whole: the stream may go quiet)
        while chunk is not None:
            i = chunk.get("index", 0)
            if i not in sent_text:
                sent_text[i] = 0
                opening = self.opening_choice(i)
                if opening is not None:
                    yield event([opening])
            delta = chunk["text"][sent_text[i] :]
            sent_text[i] = len(chunk["text"])
            entries = reply_entries(chunk["meta_info"])
            if ("chunk", i) not in progress:  # (a choice's first chunk may carry the prompt's ids)
                entries += len(chunk.get("prompt_token_ids", ()))
            meta = merged.setdefault(i, StreamMerger()).merge(chunk["meta_info"])
            progress[("chunk", i)] = chunk  # (the chunk itself: its cumulative ids, for a choice that sends them)
            # A chunk with many logprobs (an echoed prompt's, the first chunk) is built off the event loop.
            events = await built_off_loop_if_large(
                entries, self._chunk_events, req, i, delta, meta, progress, event
            )
            for one in keepalive.events(list(events)):
                yield one
            last[i] = chunk
            chunk = await anext(gen, None)
        if req.include_usage or self.include_usage:
            outs = [last[i] for i in sorted(last)]
            yield event([], usage=UsageInfo(**usage(outs, req.n)))


def as_list(outputs: Any) -> list[dict]:
    return outputs if isinstance(outputs, list) else [outputs]


def finish_reason(meta: dict) -> tuple[str | None, Any]:
    """(OpenAI finish_reason, matched stop) from SGLang's finish_reason dict."""
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    return reason.get("type"), reason.get("matched")


def usage(outputs: list[dict], n: int) -> dict[str, Any]:
    """Prompt and cached tokens count once per prompt (the first of its n samples)."""
    firsts = outputs[::n]
    prompt = sum(o["meta_info"]["prompt_tokens"] for o in firsts)
    completion = sum(o["meta_info"]["completion_tokens"] for o in outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(o["meta_info"]["cached_tokens"] for o in firsts)},
    }
