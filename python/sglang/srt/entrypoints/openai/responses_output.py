"""A Responses reply's output items, built the same way whole and streamed (so a stream builds exactly what
the whole reply has): the chat route's parsers split the answer into reasoning, content and calls, and
`OutputBuilder` turns those into items in OpenAI's order, `reasoning`, one `message`, then the calls
(`function_call`, `custom_tool_call`), with the stream's events. Text after a call joins the message (as
the chat route's answer has it); calls are sent when the answer ends (a call is whole only when its block
closes, and the model stops after its calls). A reply cut by max_output_tokens marks the item being
written when it was cut `incomplete` (the message, else the reasoning); the rest are `completed`.

The message's logprobs are those of its own tokens: each output token's text goes through a second pair
of the route's parsers, and a token counts where it releases content (`ContentTokens`).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import orjson

from sglang.srt.entrypoints.openai.responses_items import (
    message_item,
    new_id,
    output_text,
    reasoning_item,
    tool_call_item,
)


class ContentTokens:
    """Which output tokens make the message's text, fed token by token (logprob entries as the chat
    route gives them: token, logprob, bytes, top_logprobs). Their text goes through a second pair of the
    route's parsers a character at a time: what a parser holds is always the end of what it was fed, so
    each character it stops holding is resolved, and of the characters one step resolves the content it
    releases is the last (what comes before it was a tag, a call, reasoning or a dropped separator). A
    token is the message's where one of its characters is."""

    def __init__(self, reasoning_parser: Any, tool_parser: Any, forced: bool):
        """The route's parsers for this request (None where it has none); `forced`: a forced tool call,
        whose answer is a message only where it is no call (cut short): then every token is its."""
        self.reasoning, self.tools, self.forced = reasoning_parser, tool_parser, forced
        self.entries: list[dict[str, Any]] = []
        self.pending: deque[int] = deque()  # per character not yet resolved: its token's index
        self.kept = -1  # the last token found to be the message's

    def keep(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The tokens among those fed so far newly found to be the message's, in order."""
        if self.forced:
            return entries
        first = len(self.entries)
        self.entries += entries
        kept: list[dict[str, Any]] = []
        for index in range(first, len(self.entries)):
            for char in self.entries[index]["token"]:
                self.pending.append(index)
                reasoning, content = self.reasoning.feed(char) if self.reasoning is not None else ("", char)
                if self.tools is not None and content:
                    content = self.tools.feed(content)[0]
                kept += self._resolve(len(content))
        return kept

    def finish(self) -> list[dict[str, Any]]:
        """The tokens whose text the parsers release at the end."""
        if self.forced:
            return []
        content = self.reasoning.finish()[1] if self.reasoning is not None else ""
        if self.tools is not None:
            content = self.tools.feed(content)[0] + self.tools.finish()
        return self._resolve(len(content))

    def _resolve(self, released: int) -> list[dict[str, Any]]:
        held = len(getattr(self.reasoning, "_buf", "")) + len(getattr(self.tools, "_buf", ""))
        resolved = [self.pending.popleft() for _ in range(max(0, len(self.pending) - held))]
        kept = []
        for index in resolved[len(resolved) - min(released, len(resolved)) :]:
            if index > self.kept:
                self.kept = index
                kept.append(self.entries[index])
        return kept


class OutputBuilder:
    """A reply's output items (into `response["output"]`) and the stream's events, numbered."""

    def __init__(self, response: dict, custom: set[str], blob: bool, logprobs: bool):
        """`custom`: the request's custom tools; `blob`: reasoning items carry encrypted_content;
        `logprobs`: the message's text carries its tokens' logprobs."""
        self.response = response
        self.custom, self.blob, self.logprobs = custom, blob, logprobs
        self.seq = 0
        self.reasoning_at: int | None = None  # the open reasoning item's index
        self.message_at: int | None = None  # the message's index (open until the end)
        self.texts: dict[int, list[str]] = {}
        self.tokens: list[dict[str, Any]] = []  # the message's logprob entries
        self.pending: list[dict[str, Any]] = []  # ... not yet sent with a delta
        self.calls: list[dict[str, Any]] = []

    @property
    def output(self) -> list[dict[str, Any]]:
        return self.response["output"]

    def emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, **fields, "sequence_number": self.seq}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"

    def _add(self, item: dict[str, Any]) -> list[bytes]:
        self.output.append(item)
        index = len(self.output) - 1
        self.texts[index] = []
        events = [self.emit("response.output_item.added", output_index=index, item=item)]
        if item["type"] == "message":
            part = output_text("", [])
            events.append(self.emit("response.content_part.added", item_id=item["id"], output_index=index,
                                    content_index=0, part=part))  # fmt: skip
        return events

    def reasoning(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        events = []
        if self.reasoning_at is None:
            events += self._add(reasoning_item(new_id("rs"), "", "in_progress"))
            self.reasoning_at = len(self.output) - 1
        self.texts[self.reasoning_at].append(delta)
        item_id = self.output[self.reasoning_at]["id"]
        events.append(self.emit("response.reasoning_text.delta", item_id=item_id, output_index=self.reasoning_at,
                                content_index=0, delta=delta))  # fmt: skip
        return events

    def tokens_of_content(self, entries: list[dict[str, Any]]) -> None:
        """The message's logprob entries (sent with the next content delta)."""
        self.tokens += entries
        self.pending += entries

    def content(self, delta: str) -> list[bytes]:
        if not delta:
            return []
        events = self._close_reasoning("completed")
        if self.message_at is None:
            events += self._add(message_item(new_id("msg"), None, "in_progress"))
            self.message_at = len(self.output) - 1
        self.texts[self.message_at].append(delta)
        logprobs, self.pending = self.pending, []
        events.append(self.emit("response.output_text.delta", item_id=self.output[self.message_at]["id"],
                                output_index=self.message_at, content_index=0, delta=delta,
                                logprobs=logprobs if self.logprobs else []))  # fmt: skip
        return events

    def call(self, call: dict[str, Any]) -> None:
        self.calls.append(call)

    def _close_reasoning(self, status: str) -> list[bytes]:
        index, self.reasoning_at = self.reasoning_at, None
        if index is None:
            return []
        item = reasoning_item(self.output[index]["id"], "".join(self.texts[index]), status, self.blob)
        self.output[index] = item
        text = item["content"][0]["text"] if item["content"] else ""
        return [
            self.emit("response.reasoning_text.done", item_id=item["id"], output_index=index, content_index=0,
                      text=text),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]  # fmt: skip

    def finish(self, cut: bool) -> list[bytes]:
        """The answer ended (`cut`: by max_output_tokens): the open items' done events, then the calls."""
        events = []
        if not self.output and not self.calls:  # an empty answer: an empty message
            events += self._add(message_item(new_id("msg"), None, "in_progress"))
            self.message_at = len(self.output) - 1
        events += self._close_reasoning("incomplete" if cut and self.message_at is None else "completed")
        if self.message_at is not None:
            events += self._close_message("incomplete" if cut else "completed")
        for call in self.calls:
            item = tool_call_item(call, self.custom)
            custom = item["type"] == "custom_tool_call"
            field = "input" if custom else "arguments"
            events += self._add(dict(item, **{field: ""}, status="in_progress"))
            index = len(self.output) - 1
            self.output[index] = item
            where = {"item_id": item["id"], "output_index": index}
            if custom:
                events.append(self.emit("response.custom_tool_call_input.delta", **where, delta=item["input"]))
                events.append(self.emit("response.custom_tool_call_input.done", **where, input=item["input"]))
            else:
                events.append(self.emit("response.function_call_arguments.delta", **where, delta=item["arguments"]))
                events.append(self.emit("response.function_call_arguments.done", **where, name=item["name"],
                                        arguments=item["arguments"]))  # fmt: skip
            events.append(self.emit("response.output_item.done", output_index=index, item=item))
        return events

    def _close_message(self, status: str) -> list[bytes]:
        index = self.message_at
        text = "".join(self.texts[index])
        item = message_item(self.output[index]["id"], text, status, self.tokens if self.logprobs else None)
        self.output[index] = item
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self.emit("response.output_text.done", **where, text=text, logprobs=self.tokens if self.logprobs else []),
            self.emit("response.content_part.done", **where, part=item["content"][0]),
            self.emit("response.output_item.done", output_index=index, item=item),
        ]
