"""OpenAI's Responses API, as upstream SGLang serves it for any chat model: `POST /v1/responses` (whole or
streamed as Responses events), and with --enable-response-store `GET` / `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel`, `previous_response_id` and
`background`.

A request becomes a chat completion request (`responses_protocol`), which the chat serving runs: the chat
template with the request's function tools, the reasoning and tool-call parsers, grammars for
`text.format` and forcing `tool_choice`s. Its answer becomes output items (`responses_items`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from sglang.srt.entrypoints.http_errors import (
    backend_dead_body,
    internal_error_body,
    json_response,
    server_abort_body,
)
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.response_store import ResponseStore, StoredResponse
from sglang.srt.entrypoints.openai.responses_items import (
    input_messages,
    message_item,
    new_id,
    output_items,
    output_messages,
    output_text,
    reasoning_item,
    tool_call_item,
)
from sglang.srt.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    responses_abort,
    responses_error,
)
from sglang.srt.entrypoints.openai.serving_base import SSEResponse, parse_model, start_generation, usage
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import BackendDeadError, ClientDisconnected, ServerAbortError
from sglang.srt.managers.tokenizer_output import StreamMerger

logger = logging.getLogger(__name__)

# Background responses generating at once, at most (each returns at once and runs on: without a bound one
# client could queue any number); one more is a 429.
MAX_BACKGROUND = 256
REASONING_INCLUDE = "reasoning.encrypted_content"
STORE_NEEDED = "needs the response store: start the server with --enable-response-store"


def _logprob_entries(logprobs: Any) -> list[dict[str, Any]]:
    """The chat route's logprobs (ChoiceLogprobs) as output_text logprobs."""
    if logprobs is None:
        return []
    return [e.model_dump(exclude_none=True) for e in logprobs.content]


class OpenAIServingResponses:
    def __init__(self, chat: OpenAIServingChat, store: ResponseStore | None, caches_prompts: bool = True):
        """`store`: --enable-response-store's (None: off); `caches_prompts`: the radix cache is on (a
        prompt's uncached tokens are written to it: usage's cache_write_tokens)."""
        self.chat = chat
        self.tm = chat.tm
        self.store = store
        self.caches_prompts = caches_prompts
        self._background: dict[str, asyncio.Task] = {}

    # ---- POST /v1/responses ----------------------------------------------------------------------------

    async def create(self, request: Request) -> Response:
        if self.tm.tokenizer is None:
            raise responses_error(self.chat.tokenizer_needed(request.url.path))
        req = parse_model(ResponsesRequest, await request.body())
        stored = self.store is not None and req.store
        if self.store is None and (req.previous_response_id or req.background):
            field = "previous_response_id" if req.previous_response_id else "background"
            raise RequestError(f"{field} {STORE_NEEDED}.", field)
        if req.background and req.stream:
            raise RequestError("stream: a background response is polled (GET /v1/responses/{id}), not "
                               "streamed; set stream to false.", "stream")  # fmt: skip
        if req.background and not req.store:
            raise RequestError("store: a background response is stored; set store to true.", "store")
        history = self._previous_conversation(req.previous_response_id)
        messages = history + input_messages(req.input)
        instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
        chat_req = req.chat_request(instructions + messages)
        try:
            obj = await self.chat.to_generate_input(chat_req)
            obj.lora_path = self.chat.adapter_of(chat_req)
        except RequestError as e:
            raise responses_error(self.chat.rename(e)) from None
        response = self._skeleton(req, stored)
        record = StoredResponse(response, _input_items(req.input), messages) if stored else None
        if req.background:
            if len(self._background) >= MAX_BACKGROUND:
                raise ServerAbortError(429, f"{MAX_BACKGROUND} background responses are running; wait for one.")
            response["status"] = "queued"
            self.store.put(record)
            task = asyncio.create_task(self._run_background(req, chat_req, obj, record))
            self._background[response["id"]] = task
            task.add_done_callback(lambda _t, rid=response["id"]: self._background.pop(rid, None))
            return json_response(response)
        first, gen = await self._start(chat_req, obj, request)
        if req.stream:
            return SSEResponse(self._stream(req, chat_req, first, gen, response, record))
        await gen.aclose()
        self._finish(req, chat_req, response, first, record)
        return json_response(response)

    async def _start(self, chat_req: ChatCompletionRequest, obj: Any, request: Request | None) -> tuple[Any, Any]:
        try:
            return await start_generation(self.tm, obj, request)
        except RequestError as e:
            raise responses_error(self.chat.rename(e)) from None
        except ServerAbortError as e:
            raise responses_abort(self.chat.rename_abort(chat_req, e)) from None

    def _previous_conversation(self, rid: str | None) -> list[dict[str, Any]]:
        if rid is None:
            return []
        entry = self.store.get(rid)
        if entry is None:
            raise RequestError(f"previous_response_id: no stored response has id {rid!r}.", "previous_response_id")
        if entry.response["status"] in ("queued", "in_progress"):
            raise RequestError(f"previous_response_id: response {rid!r} has not finished.", "previous_response_id")
        return entry.conversation

    def _skeleton(self, req: ResponsesRequest, stored: bool) -> dict[str, Any]:
        return {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": req.background, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": req.model or self.chat.model_name, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "reasoning": req.reasoning or {"effort": None, "summary": None}, "store": stored,
            "temperature": req.temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice or "auto", "tools": req.echoed_tools(),
            "top_logprobs": req.top_logprobs, "top_p": req.top_p, "truncation": req.truncation or "disabled",
            "usage": None, "user": req.user, "metadata": req.metadata or {},
        }  # fmt: skip

    def _usage(self, out: dict, reasoning: str) -> dict[str, Any]:
        u = usage([out], 1)
        cached = u["prompt_tokens_details"]["cached_tokens"]
        reasoning_tokens = len(self.tm.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        return {
            "input_tokens": u["prompt_tokens"],
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": u["prompt_tokens"] - cached if self.caches_prompts else 0,
            },
            "output_tokens": u["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens, u["completion_tokens"])},
            "total_tokens": u["total_tokens"],
        }

    def _settle(self, response: dict, out: dict, reason: str | None, reasoning: str) -> None:
        """A response's final status and usage from its output's finish reason."""
        response["status"] = {"length": "incomplete", "abort": "cancelled"}.get(reason or "", "completed")
        if reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        response["usage"] = self._usage(out, reasoning)
        response["completed_at"] = int(time.time())

    def _finish(
        self, req: ResponsesRequest, chat_req: ChatCompletionRequest, response: dict, out: dict, record: Any
    ) -> None:
        """A whole output's items, status and usage into `response` (and the store)."""
        choice = self.chat.make_choice(chat_req, 0, out)
        m = choice.message
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        logprobs = _logprob_entries(choice.logprobs) if chat_req.logprobs else None
        response["output"] = output_items(m.reasoning_content, m.content, m.tool_calls, status, logprobs,
                                          req.custom_tool_names(), REASONING_INCLUDE in (req.include or []))
        self._settle(response, out, choice.finish_reason, m.reasoning_content or "")
        self._keep(record, response)

    def _keep(self, record: StoredResponse | None, response: dict) -> None:
        if record is None:
            return
        record.conversation = record.conversation + output_messages(response["output"])
        if not self.store.put(StoredResponse(response, record.input_items, record.conversation)):
            logger.warning("Response %s is larger than --response-store-max-mb and is not stored.", response["id"])

    # ---- background ------------------------------------------------------------------------------------

    async def _run_background(
        self, req: ResponsesRequest, chat_req: ChatCompletionRequest, obj: Any, record: StoredResponse
    ) -> None:
        response = dict(record.response, status="in_progress")
        self.store.update(response)
        try:
            first, gen = await self._start(chat_req, obj, None)
            await gen.aclose()
            self._finish(req, chat_req, response, first, record)
        except asyncio.CancelledError:
            self.store.update(dict(response, status="cancelled"))
            raise
        except (RequestError, ServerAbortError, BackendDeadError) as e:
            message = getattr(e, "message", None) or str(e)
            self.store.update(dict(response, status="failed", error={"code": "server_error", "message": message}))
        except Exception as e:  # noqa: BLE001 - the response records it; nobody waits on this task
            logger.exception("Background response %s failed", response["id"])
            self.store.update(dict(response, status="failed", error={"code": "server_error", "message": str(e)}))

    async def cancel(self, rid: str) -> Response:
        entry = self._stored(rid)
        if not entry.response.get("background"):
            raise RequestError(f"Response {rid!r} is not a background response; only those can be cancelled.",
                               "response_id")  # fmt: skip
        task = self._background.get(rid)
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        return json_response(self._stored(rid).response)

    # ---- the store's routes ----------------------------------------------------------------------------

    def _stored(self, rid: str) -> StoredResponse:
        if self.store is None:
            raise HTTPException(404, f"Stored responses {STORE_NEEDED}")
        entry = self.store.get(rid)
        if entry is None:
            raise HTTPException(404, f"No stored response has id {rid!r}")
        return entry

    def retrieve(self, rid: str) -> Response:
        return json_response(self._stored(rid).response)

    async def delete(self, rid: str) -> Response:
        self._stored(rid)
        task = self._background.get(rid)
        if task is not None:
            task.cancel()
        self.store.delete(rid)
        return json_response({"id": rid, "object": "response.deleted", "deleted": True})

    def input_items(self, rid: str, order: str = "desc", limit: int = 20, after: str | None = None) -> Response:
        if order not in ("asc", "desc") or not 1 <= limit <= 100:
            param = "order" if order not in ("asc", "desc") else "limit"
            raise RequestError(f"{param}: order is asc or desc, limit 1 to 100.", param)
        items = list(self._stored(rid).input_items)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise RequestError(f"after: no input item of {rid!r} has id {after!r}.", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:limit]
        return json_response({
            "object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
        })  # fmt: skip

    # ---- streaming -------------------------------------------------------------------------------------

    async def _stream(
        self, req: ResponsesRequest, chat_req: ChatCompletionRequest, first: Any, gen: Any, response: dict, record: Any
    ) -> AsyncIterator[bytes]:
        """Responses events: created, in_progress, each item's added / deltas / done, then completed
        (or incomplete); an error ends the stream with an `error` event and `response.failed`."""
        events = _EventWriter(response, req.custom_tool_names(), REASONING_INCLUDE in (req.include or []))
        yield events.emit("response.created", response=dict(response))
        yield events.emit("response.in_progress", response=dict(response))
        try:
            async for event in self._stream_items(chat_req, first, gen, response, events):
                yield event
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001 - the stream's last events say what failed
            if isinstance(e, ServerAbortError):
                body = server_abort_body(e)
            elif isinstance(e, BackendDeadError):
                body = backend_dead_body(e)
            else:
                logger.exception("Streaming a response failed")
                body = internal_error_body(e)
            error = body["error"]
            yield events.emit("error", code=str(error.get("code")), message=error["message"], param=error.get("param"))
            response.update(status="failed", error={"code": str(error.get("code")), "message": error["message"]})
            yield events.emit("response.failed", response=response)
            return
        self._keep(record, response)
        kind = {"incomplete": "response.incomplete", "cancelled": "response.failed"}.get(response["status"])
        yield events.emit(kind or "response.completed", response=response)

    async def _stream_items(
        self, chat_req: ChatCompletionRequest, chunk: Any, gen: Any, response: dict, events: _EventWriter
    ) -> AsyncIterator[bytes]:
        progress: dict[Any, Any] = {}
        merger = StreamMerger()
        sent, reason, last, reasoning = 0, None, chunk, []
        while chunk is not None:
            delta, sent = chunk["text"][sent:], len(chunk["text"])
            meta = merger.merge(chunk["meta_info"])
            for choice in self.chat.stream_choices(chat_req, 0, delta, meta, progress):
                d = choice.delta
                if choice.logprobs is not None:
                    events.pending_logprobs += _logprob_entries(choice.logprobs)
                if d.reasoning_content:
                    reasoning.append(d.reasoning_content)
                    for event in events.text("reasoning", d.reasoning_content):
                        yield event
                if d.content:
                    for event in events.text("message", d.content):
                        yield event
                for call in d.tool_calls or []:
                    for event in events.call(call):
                        yield event
                reason = choice.finish_reason or reason
            last, chunk = chunk, await anext(gen, None)
        for event in events.close("incomplete" if reason == "length" else "completed"):
            yield event
        self._settle(response, last, reason, "".join(reasoning))


class _EventWriter:
    """A stream's events, numbered, and the output items they build (`response["output"]`)."""

    def __init__(self, response: dict, custom: set[str], blob: bool):
        """`custom`: the request's custom tools; `blob`: reasoning items carry encrypted_content."""
        self.response = response
        self.custom, self.blob = custom, blob
        self.seq = 0
        self.open: dict[str, Any] | None = None  # the reasoning or message item receiving text
        self.pending_logprobs: list[dict[str, Any]] = []

    def emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _added(self, item: dict) -> bytes:
        self.response["output"].append(item)
        return self.emit("response.output_item.added", output_index=len(self.response["output"]) - 1,
                         item=dict(item, content=[]) if "content" in item else item)  # fmt: skip

    def text(self, kind: str, delta: str) -> list[bytes]:
        out = []
        if self.open is None or self.open["type"] != kind:
            out += self.close("completed")
            item = reasoning_item(new_id("rs"), "", "in_progress") if kind == "reasoning" else \
                message_item(new_id("msg"), None, "in_progress")  # fmt: skip
            self.open = dict(item, text=[])
            out.append(self._added(item))
            if kind == "message":
                out.append(self._part("response.content_part.added", item["id"], output_text("", [])))
        self.open["text"].append(delta)
        where = {"item_id": self.open["id"], "output_index": len(self.response["output"]) - 1, "content_index": 0}
        if kind == "reasoning":
            out.append(self.emit("response.reasoning_text.delta", **where, delta=delta))
        else:
            logprobs, self.pending_logprobs = self.pending_logprobs, []
            self.open.setdefault("logprobs", []).extend(logprobs)
            out.append(self.emit("response.output_text.delta", **where, delta=delta, logprobs=logprobs))
        return out

    def _part(self, kind: str, item_id: str, part: dict) -> bytes:
        return self.emit(kind, item_id=item_id, output_index=len(self.response["output"]) - 1, content_index=0,
                         part=part)  # fmt: skip

    def close(self, status: str) -> list[bytes]:
        """The open text item's done events (its final form replaces its placeholder in the output)."""
        if self.open is None:
            return []
        o, self.open = self.open, None
        text, index = "".join(o["text"]), len(self.response["output"]) - 1
        where = {"item_id": o["id"], "output_index": index, "content_index": 0}
        if o["type"] == "reasoning":
            item = reasoning_item(o["id"], text, status, self.blob)
            out = [self.emit("response.reasoning_text.done", **where, text=text)]
        else:
            logprobs = o.get("logprobs", []) + self.pending_logprobs
            self.pending_logprobs = []
            item = message_item(o["id"], text, status, logprobs)
            out = [self.emit("response.output_text.done", **where, text=text, logprobs=logprobs)]
            out.append(self._part("response.content_part.done", o["id"], item["content"][0]))
        self.response["output"][index] = item
        out.append(self.emit("response.output_item.done", output_index=index, item=item))
        return out

    def call(self, call: dict[str, Any]) -> list[bytes]:
        """A whole function call (the parser hands each over when its block closes)."""
        out = self.close("completed")
        item = tool_call_item(call, self.custom)
        custom = item["type"] == "custom_tool_call"
        field = "input" if custom else "arguments"
        out.append(self._added(dict(item, **{field: ""}, status="in_progress")))
        index = len(self.response["output"]) - 1
        self.response["output"][index] = item
        where = {"item_id": item["id"], "output_index": index}
        if custom:
            out.append(self.emit("response.custom_tool_call_input.delta", **where, delta=item["input"]))
            out.append(self.emit("response.custom_tool_call_input.done", **where, input=item["input"]))
        else:
            out.append(self.emit("response.function_call_arguments.delta", **where, delta=item["arguments"]))
            out.append(self.emit("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=item["arguments"]))  # fmt: skip
        out.append(self.emit("response.output_item.done", output_index=index, item=item))
        return out


def _input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input as stored items, each with an id (`GET /v1/responses/{id}/input_items`)."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    out = []
    for item in items:
        item = dict(item, type=item.get("type", "message"))
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "reasoning": "rs"}.get(item["type"], "item")
        item.setdefault("id", new_id(prefix))
        item.setdefault("status", "completed")
        out.append(item)
    return out
