"""OpenAI's Responses API, as upstream SGLang serves it for any chat model: `POST /v1/responses` (whole or
streamed as Responses events), and with --enable-response-store `GET` / `DELETE /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items`, `POST /v1/responses/{id}/cancel`, `previous_response_id` and
`background`.

A request becomes a chat completion request (`responses_protocol`), which the chat serving runs: the chat
template with the request's tools, the reasoning and tool-call parsers, grammars for `text.format` and
forcing `tool_choice`s. Its answer becomes output items (`responses_output`, one builder for the whole
reply and the stream). A stored response keeps its conversation as items (the previous turns', its input,
its output), so a chained turn renders exactly what sending those items again renders.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

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
from sglang.srt.entrypoints.openai.response_store import RUNNING, ResponseStore, StoredResponse
from sglang.srt.entrypoints.openai.responses_items import input_messages, new_id, stored_input_items
from sglang.srt.entrypoints.openai.responses_output import ContentTokens, OutputBuilder
from sglang.srt.entrypoints.openai.responses_protocol import (
    ResponsesRequest,
    responses_abort,
    responses_error,
)
from sglang.srt.entrypoints.openai.serving_base import (
    SSEResponse,
    parse_json_model,
    start_generation,
    usage,
)
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat, chat_logprobs
from sglang.srt.entrypoints.stream_keepalive import SSE_COMMENT, Keepalive
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import BackendDeadError, ClientDisconnected, ServerAbortError
from sglang.srt.managers.tokenizer_output import StreamMerger, built_off_loop_if_large, reply_entries

logger = logging.getLogger(__name__)

# Background responses generating at once, at most, over all clients (each returns at once and runs on:
# without a bound one client could queue any number); one more is a 429.
MAX_BACKGROUND = 256
REASONING_INCLUDE = "reasoning.encrypted_content"

STORE_NEEDED = "needs the response store: start the server with --enable-response-store"
# The most reasoning text a request's encrypted_content blobs may restore, per token of context.
REASONING_CHARS_PER_TOKEN = 16


class _Turn:
    """One request's parts: the request, its chat request, and what its reply is built with."""

    def __init__(self, serving: OpenAIServingResponses, req: ResponsesRequest, chat_req: ChatCompletionRequest):
        self.req, self.chat_req, self.chat = req, chat_req, serving.chat
        self.custom = req.custom_tool_names()
        self.blob = REASONING_INCLUDE in (req.include or [])
        self._content_tokens: ContentTokens | None = None

    @property
    def content_tokens(self) -> ContentTokens:
        """(Made once the prompt is rendered: whether it opens a think block decides the parsing.)"""
        if self._content_tokens is None:
            self._content_tokens = ContentTokens(*self.chat.answer_parsers(self.chat_req), self.chat_req.forces_tool_calls)
        return self._content_tokens

    def builder(self, response: dict) -> OutputBuilder:
        return OutputBuilder(response, self.custom, self.blob, self.chat_req.logprobs)


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
        req = parse_json_model(ResponsesRequest, await request.body())
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
        items = stored_input_items(req.input)
        budget = self.tm.limits.context_len * REASONING_CHARS_PER_TOKEN
        messages = input_messages(history + items, offset=len(history), max_reasoning_chars=budget)
        instructions = [{"role": "system", "content": req.instructions}] if req.instructions else []
        turn = _Turn(self, req, req.chat_request(instructions + messages))
        try:
            obj = await self.chat.to_generate_input(turn.chat_req)
            obj.lora_path = self.chat.adapter_of(turn.chat_req)
        except RequestError as e:
            raise self._renamed(turn, e) from None
        response = self._skeleton(req, stored)
        conversation = history + items if stored else None
        if req.background:
            return self._start_background(turn, obj, response, items, conversation)
        first, gen = await self._start(turn, obj, request)
        if req.stream:
            return SSEResponse(self._stream(turn, first, gen, response, items, conversation))
        await gen.aclose()
        await self._finish(turn, response, first, items, conversation)
        return json_response(response)

    def _renamed(self, turn: _Turn, err: RequestError) -> RequestError:
        err = self.chat.rename(err)
        if err.param == "json_schema" and turn.chat_req.grammar_origin:  # (a grammar the route made)
            err = RequestError(err.message, turn.chat_req.grammar_origin, err.code)
        return responses_error(err)

    async def _start(self, turn: _Turn, obj: Any, request: Request | None) -> tuple[Any, Any]:
        try:
            return await start_generation(self.tm, obj, request)
        except RequestError as e:
            raise self._renamed(turn, e) from None
        except ServerAbortError as e:
            raise responses_abort(self.chat.rename_abort(turn.chat_req, e)) from None

    def _previous_conversation(self, rid: str | None) -> list[dict[str, Any]]:
        if rid is None:
            return []
        entry = self.store.get(rid)
        if entry is None:
            raise RequestError(f"previous_response_id: no stored response has id {rid!r}.", "previous_response_id")
        if entry.status in RUNNING:
            raise RequestError(f"previous_response_id: response {rid!r} has not finished.", "previous_response_id")
        return entry.conversation()

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

    def _settle(self, response: dict, out: dict, reason: str | None) -> None:
        """A response's final status and usage from its output's finish reason."""
        response["status"] = {"length": "incomplete", "abort": "cancelled"}.get(reason or "", "completed")
        if reason == "length":
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        reasoning = "".join(
            i["content"][0]["text"] for i in response["output"] if i["type"] == "reasoning" and i["content"]
        )
        response["usage"] = self._usage(out, reasoning)
        response["completed_at"] = int(time.time())

    async def _finish(
        self, turn: _Turn, response: dict, out: dict, items: list, conversation: list | None
    ) -> None:
        """A whole output's items, status and usage into `response` (and the store): built off the event
        loop where its logprobs are many, as the native route's long replies are (`tokenizer_output`)."""
        await built_off_loop_if_large(reply_entries(out["meta_info"]), self._build_output, turn, response, out)
        self._keep(response, items, conversation)

    def _build_output(self, turn: _Turn, response: dict, out: dict) -> None:
        choice = self.chat.make_choice(turn.chat_req, 0, out)
        m = choice.message
        builder = turn.builder(response)
        if turn.chat_req.logprobs:  # (the choice's own logprobs, every output token's: the message's kept)
            entries = choice.logprobs.content
            builder.tokens_of_content(turn.content_tokens.keep(entries) + turn.content_tokens.finish())
        builder.reasoning(m.reasoning_content or "")
        builder.content(m.content or "")
        for call in m.tool_calls or []:
            builder.call(call)
        builder.finish(choice.finish_reason == "length")
        self._settle(response, out, choice.finish_reason)

    def _keep(self, response: dict, items: list, conversation: list | None) -> None:
        """Store a finished response (a background one only if it is still stored: not deleted)."""
        if conversation is None:
            return
        entry = StoredResponse.of(response, items, conversation + response["output"])
        kept = self.store.replace(entry, _stub(response)) if response["background"] else self.store.put(entry)
        if not kept and not response["background"]:
            response["store"] = False  # (the reply says so)
            logger.warning("Response %s does not fit --response-store-max-mb and is not stored.", response["id"])

    # ---- background ------------------------------------------------------------------------------------

    def _start_background(self, turn: _Turn, obj: Any, response: dict, items: list, conversation: list) -> Response:
        if len(self._background) >= MAX_BACKGROUND:
            raise ServerAbortError(429, f"{MAX_BACKGROUND} background responses are running; wait for one.")
        response["status"] = "queued"
        if not self.store.put(StoredResponse.of(response, items, conversation)):
            raise ServerAbortError(
                503, "The response store has no room for another background response (--response-store-max-mb)."
            )
        rid = response["id"]
        task = asyncio.create_task(self._run_background(turn, obj, response, items, conversation))
        self._background[rid] = task
        task.add_done_callback(lambda _t: self._background_done(rid, response))
        return json_response(response)

    def _background_done(self, rid: str, response: dict) -> None:
        """A background task ended: a response it left running (a task cancelled before it started) is
        cancelled."""
        self._background.pop(rid, None)
        entry = self.store.get(rid)
        if entry is not None and entry.status in RUNNING:
            stub = _stub(response, "cancelled")
            self.store.replace(stub, stub)

    async def _run_background(self, turn: _Turn, obj: Any, response: dict, items: list, conversation: list) -> None:
        response = dict(response, status="in_progress")
        self.store.replace(StoredResponse.of(response, items, conversation))
        try:
            first, gen = await self._start(turn, obj, None)
            await gen.aclose()
            await self._finish(turn, response, first, items, conversation)
        except asyncio.CancelledError:
            cancelled = dict(response, status="cancelled")
            self.store.replace(StoredResponse.of(cancelled, items, conversation), _stub(cancelled))
            raise
        except Exception as e:  # noqa: BLE001 - the response records it; nobody waits on this task
            if not isinstance(e, RequestError | ServerAbortError | BackendDeadError):
                logger.exception("Background response %s failed", response["id"])
            error = {"code": "server_error", "message": getattr(e, "message", None) or str(e)}
            failed = dict(response, status="failed", error=error)
            self.store.replace(StoredResponse.of(failed, items, conversation), _stub(failed))

    async def cancel(self, rid: str) -> Response:
        task = self._background.get(rid)
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        entry = self._stored(rid)
        response = entry.response()
        if not response.get("background"):
            raise RequestError(f"Response {rid!r} is not a background response; only those can be cancelled.",
                               "response_id")  # fmt: skip
        return json_response(response)

    # ---- the store's routes ----------------------------------------------------------------------------

    def _stored(self, rid: str) -> StoredResponse:
        if self.store is None:
            raise HTTPException(404, f"Stored responses {STORE_NEEDED}")
        entry = self.store.get(rid)
        if entry is None:
            raise HTTPException(404, f"No stored response has id {rid!r}")
        return entry

    def retrieve(self, rid: str) -> Response:
        return Response(self._stored(rid).response_json, media_type="application/json")

    async def delete(self, rid: str) -> Response:
        task = self._background.get(rid)
        self._stored(rid)
        self.store.delete(rid)
        if task is not None:
            task.cancel()
        return json_response({"id": rid, "object": "response.deleted", "deleted": True})

    def input_items(self, rid: str, order: str = "desc", limit: str = "20", after: str | None = None) -> Response:
        if order not in ("asc", "desc"):
            raise RequestError(f"order: {order!r} is not asc or desc.", "order")
        if not (limit.isascii() and limit.isdigit()) or not 1 <= int(limit) <= 100:
            raise RequestError(f"limit: {limit!r} is not an integer from 1 to 100.", "limit")
        items, n = self._stored(rid).input_items(), int(limit)
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            if after not in ids:
                raise RequestError(f"after: no input item of {rid!r} has id {after!r}.", "after")
            items = items[ids.index(after) + 1 :]
        page = items[:n]
        return json_response({
            "object": "list", "data": page, "has_more": len(items) > n,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
        })  # fmt: skip

    # ---- streaming -------------------------------------------------------------------------------------

    async def _stream(
        self, turn: _Turn, first: Any, gen: Any, response: dict, items: list, conversation: list | None
    ) -> AsyncIterator[bytes]:
        """Responses events: created, in_progress, each item's added / deltas / done, then completed
        (or incomplete); an error ends the stream with an `error` event and `response.failed`."""
        builder = turn.builder(response)
        yield builder.emit("response.created", response=dict(response))
        yield builder.emit("response.in_progress", response=dict(response))
        try:
            async for event in self._stream_items(turn, first, gen, response, builder):
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
            yield builder.emit("error", code=str(error.get("code")), message=error["message"], param=error.get("param"))
            code = "rate_limit_exceeded" if error.get("code") == 429 else "server_error"
            response.update(status="failed", error={"code": code, "message": error["message"]})
            yield builder.emit("response.failed", response=response)
            return
        finally:
            await gen.aclose()  # (a client gone: the request is aborted now, not when the loop collects it)
        self._keep(response, items, conversation)
        kind = {"incomplete": "response.incomplete", "cancelled": "response.failed"}.get(response["status"])
        yield builder.emit(kind or "response.completed", response=response)

    async def _stream_items(
        self, turn: _Turn, chunk: Any, gen: Any, response: dict, builder: OutputBuilder
    ) -> AsyncIterator[bytes]:
        progress: dict[Any, Any] = {}
        merger = StreamMerger()
        sent, sent_tokens, reason, last = 0, 0, None, chunk
        keepalive = Keepalive(SSE_COMMENT)
        while chunk is not None:
            delta, sent = chunk["text"][sent:], len(chunk["text"])
            meta = merger.merge(chunk["meta_info"])
            if turn.chat_req.logprobs:  # (the chat route's choices carry them too; these are per token)
                entries = chat_logprobs(meta, sent_tokens).content
                sent_tokens += len(entries)
                builder.tokens_of_content(turn.content_tokens.keep(entries))
                if meta.get("finish_reason"):  # (what the end releases goes with this chunk's last delta)
                    builder.tokens_of_content(turn.content_tokens.finish())
            events = []
            for choice in self.chat.stream_choices(turn.chat_req, 0, delta, meta, progress):
                events += builder.reasoning(choice.delta.reasoning_content or "")
                events += builder.content(choice.delta.content or "")
                for call in choice.delta.tool_calls or []:
                    builder.call(call)
                reason = choice.finish_reason or reason
            for event in keepalive.events(events):
                yield event
            last, chunk = chunk, await anext(gen, None)
        for event in builder.finish(reason == "length"):
            yield event
        self._settle(response, last, reason)


def _stub(response: dict, status: str | None = None) -> StoredResponse:
    """What a background response's end becomes where it does not fit the store: its request's fields,
    no output, and why (a cancelled one: just that)."""
    stub = dict(response, output=[], usage=None, status=status or response["status"])
    if stub["status"] != "cancelled":
        message = "The response does not fit the response store (--response-store-max-mb); it was not kept."
        stub.update(status="failed", error={"code": "server_error", "message": message})
    return StoredResponse.of(stub, [], [])
