"""Anthropic's Messages API, as upstream SGLang serves it for any chat model: `POST /v1/messages` (whole, or
streamed as Anthropic's events) and `POST /v1/messages/count_tokens`, over the chat serving
(`protocol.py` translates the request).

The reply's content blocks come in one order, whole and streamed (one builder makes both): `thinking`
(with --reasoning-parser), one `text` block (text the model writes after a call joins it), then the
`tool_use` blocks (sent when the answer ends: a call is whole only when its block closes, and the model
stops after its calls). `stop_reason`: `end_turn`, `max_tokens`, `tool_use`, or `stop_sequence` with the
`stop_sequence` matched. `usage` in Anthropic's sense: `input_tokens` the prompt tokens the prefix cache
did not hold, `cache_read_input_tokens` those it held (their sum is the prompt), `output_tokens`.
Errors are Anthropic's body, `{"type": "error", "error": {"type", "message"}}`, naming the field.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response

from sglang.srt.entrypoints.anthropic.protocol import MessagesRequest
from sglang.srt.entrypoints.openai.serving_base import SSEResponse, parse_json_model, start_generation
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.stream_keepalive import Keepalive
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import BackendDeadError, ClientDisconnected, ServerAbortError
from sglang.srt.managers.tokenizer_output import StreamMerger
from sglang.srt.utils.error_body import anthropic_error_body

logger = logging.getLogger(__name__)

STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
SIGNATURE = "sglang"  # a thinking block's signature: Anthropic's verifies a trace; this server keeps none


def error_response(status: int, message: str) -> Response:
    return Response(orjson.dumps(anthropic_error_body(status, message)), status_code=status,
                    media_type="application/json")  # fmt: skip


class _CountRequest(MessagesRequest):
    max_tokens: int = 1  # (count_tokens takes no max_tokens)


class AnthropicServing:
    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat
        self.tm = chat.tm

    async def messages(self, request: Request) -> Response:
        return await self._answering_errors(self._messages(request))

    async def count_tokens(self, request: Request) -> Response:
        return await self._answering_errors(self._count_tokens(request))

    async def _answering_errors(self, work: Any) -> Response:
        """The route's reply, its errors in Anthropic's shape (a client gone is nobody's error)."""
        try:
            return await work
        except ClientDisconnected:
            raise
        except RequestError as e:
            return error_response(400, e.message)
        except ServerAbortError as e:
            return error_response(e.status_code, e.message)
        except (BackendDeadError, TimeoutError) as e:
            return error_response(503, str(e))
        except Exception as e:  # noqa: BLE001 - in Anthropic's shape too
            logger.exception("A Messages API request failed")
            return error_response(500, f"Internal server error: {e}")

    def _parse(self, body: bytes, model: type[MessagesRequest]) -> MessagesRequest:
        if self.tm.tokenizer is None:
            raise RequestError("/v1/messages needs a tokenizer, and this server was started with "
                               "--skip-tokenizer-init; send token ids to /generate instead.", "messages")  # fmt: skip
        return parse_json_model(model, body)

    async def _count_tokens(self, request: Request) -> Response:
        chat_req = self._parse(await request.body(), _CountRequest).chat_request(count_only=True)
        try:
            ids = await self.chat.apply_chat_template(chat_req)
        except RequestError as e:
            raise self.chat.rename(e) from None
        return Response(orjson.dumps({"input_tokens": len(ids)}), media_type="application/json")

    async def _messages(self, request: Request) -> Response:
        req = self._parse(await request.body(), MessagesRequest)
        chat_req = req.chat_request()
        fmt = self.chat.reasoning_format
        if chat_req.continue_final_message and fmt is not None and fmt.always_reasoning:
            raise RequestError(
                f"messages[{len(req.messages) - 1}]: a prefilled answer (a final assistant message) is not "
                "served with a --reasoning-parser whose model always thinks first: its text would land in the "
                "thinking.",
                "messages",
            )
        try:
            obj = await self.chat.to_generate_input(chat_req)
            obj.lora_path = self.chat.adapter_of(chat_req)
            first, gen = await start_generation(self.tm, obj, request)
        except RequestError as e:
            raise self.chat.rename(e) from None
        except ServerAbortError as e:
            raise self.chat.rename_abort(chat_req, e) from None
        message = {
            "id": f"msg_{first['meta_info']['id']}", "type": "message", "role": "assistant",
            "model": req.model or self.chat.model_name, "content": [], "stop_reason": None,
            "stop_sequence": None, "usage": _usage(first, 0),
        }  # fmt: skip
        builder = _Blocks(message, set(req.stop_sequences or []))
        if req.stream:
            return SSEResponse(self._stream(chat_req, first, gen, builder))
        await gen.aclose()
        choice = self.chat.make_choice(chat_req, 0, first)
        m = choice.message
        builder.thinking(m.reasoning_content or "")
        builder.text(m.content or "")
        for call in m.tool_calls or []:
            builder.call(call)
        builder.finish(choice.finish_reason, choice.matched_stop, first)
        return Response(orjson.dumps(message), media_type="application/json")

    async def _stream(self, chat_req: Any, chunk: Any, gen: Any, builder: _Blocks) -> AsyncIterator[bytes]:
        yield builder.emit("message_start", message=dict(builder.message, content=[]))
        progress: dict[Any, Any] = {}
        merger = StreamMerger()
        sent, reason, matched, last = 0, None, None, chunk
        keepalive = Keepalive(lambda: builder.emit("ping"))  # (Anthropic's keep-alive event)
        try:
            while chunk is not None:
                delta, sent = chunk["text"][sent:], len(chunk["text"])
                meta = merger.merge(chunk["meta_info"])
                events = []
                for choice in self.chat.stream_choices(chat_req, 0, delta, meta, progress):
                    events += builder.thinking(choice.delta.reasoning_content or "")
                    events += builder.text(choice.delta.content or "")
                    for call in choice.delta.tool_calls or []:
                        builder.call(call)
                    if choice.finish_reason is not None:
                        reason, matched = choice.finish_reason, choice.matched_stop
                for event in keepalive.events(events):
                    yield event
                last, chunk = chunk, await anext(gen, None)
            for event in builder.finish(reason, matched, last):
                yield event
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001 - the stream's last event says what failed
            if isinstance(e, ServerAbortError):
                status, text = e.status_code, e.message
            elif isinstance(e, BackendDeadError):
                status, text = 503, str(e)
            else:
                logger.exception("Streaming a message failed")
                status, text = 500, f"Internal server error: {e}"
            yield builder.emit("error", **anthropic_error_body(status, text))
        finally:
            await gen.aclose()  # (a client gone: the request is aborted now)


def _usage(out: dict, output_tokens: int | None = None) -> dict[str, int]:
    meta = out["meta_info"]
    cached = meta.get("cached_tokens", 0)
    done = meta["completion_tokens"] if output_tokens is None else output_tokens
    return {"input_tokens": meta["prompt_tokens"] - cached, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached, "output_tokens": done}  # fmt: skip


class _Blocks:
    """A reply's content blocks (into `message["content"]`) and the stream's events."""

    def __init__(self, message: dict, stop_sequences: set[str]):
        self.message, self.stop_sequences = message, stop_sequences
        self.open: str | None = None  # the kind of the block receiving text: "thinking" or "text"
        self.parts: list[str] = []  # its text so far (joined when it closes: linear in the answer)
        self.has_text = False
        self.calls: list[dict[str, Any]] = []

    @property
    def blocks(self) -> list[dict[str, Any]]:
        return self.message["content"]

    def emit(self, kind: str, **fields: Any) -> bytes:
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps({"type": kind, **fields}) + b"\n\n"

    def _start(self, block: dict[str, Any]) -> bytes:
        self.blocks.append(block)
        return self.emit("content_block_start", index=len(self.blocks) - 1, content_block=dict(block))

    def _close(self) -> list[bytes]:
        kind, self.open = self.open, None
        if kind is None:
            return []
        index = len(self.blocks) - 1
        self.blocks[index][kind] = "".join(self.parts)
        self.parts = []
        events = []
        if kind == "thinking":
            self.blocks[index]["signature"] = SIGNATURE
            events.append(self.emit("content_block_delta", index=index,
                                    delta={"type": "signature_delta", "signature": SIGNATURE}))  # fmt: skip
        return events + [self.emit("content_block_stop", index=index)]

    def thinking(self, delta: str) -> list[bytes]:
        if not delta or self.has_text:  # (reasoning comes first; none after the answer's text)
            return []
        events = []
        if self.open != "thinking":
            events.append(self._start({"type": "thinking", "thinking": "", "signature": ""}))
            self.open = "thinking"
        self.parts.append(delta)
        events.append(self.emit("content_block_delta", index=len(self.blocks) - 1,
                                delta={"type": "thinking_delta", "thinking": delta}))  # fmt: skip
        return events

    def text(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        events = []
        if self.open != "text":
            events += self._close()
            events.append(self._start({"type": "text", "text": ""}))
            self.open, self.has_text = "text", True
        self.parts.append(delta)
        events.append(self.emit("content_block_delta", index=len(self.blocks) - 1,
                                delta={"type": "text_delta", "text": delta}))  # fmt: skip
        return events

    def call(self, call: dict[str, Any]) -> None:
        self.calls.append(call)

    def finish(self, reason: str | None, matched: Any, last: dict) -> list[bytes]:
        """The answer ended: the open block's stop, the calls' blocks, the stop reason and usage."""
        events = self._close()
        for call in self.calls:
            try:  # (orjson: an integer past 64 bits becomes a float the reply can carry)
                arguments = orjson.loads(call["function"]["arguments"])
            except orjson.JSONDecodeError:
                arguments = None
            block = {"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                     "input": arguments if isinstance(arguments, dict) else {}}  # fmt: skip
            events.append(self._start(dict(block, input={})))
            self.blocks[-1] = block
            index = len(self.blocks) - 1
            events.append(self.emit("content_block_delta", index=index,
                                    delta={"type": "input_json_delta",
                                           "partial_json": orjson.dumps(block["input"]).decode()}))  # fmt: skip
            events.append(self.emit("content_block_stop", index=index))
        stop = "end_turn"
        if reason == "stop" and isinstance(matched, str) and matched in self.stop_sequences:
            stop = "stop_sequence"
            self.message["stop_sequence"] = matched
        stop = STOP_REASONS.get(reason or "", stop)
        self.message["stop_reason"] = stop
        self.message["usage"] = _usage(last)
        delta = {"stop_reason": stop, "stop_sequence": self.message["stop_sequence"]}
        events.append(self.emit("message_delta", delta=delta, usage=self.message["usage"]))
        events.append(self.emit("message_stop"))
        return events
