"""`--tool-call-parser` (upstream's flag): a chat answer's tool calls into `message.tool_calls`.

`qwen25` (alias `qwen`; Qwen2.5 / Qwen3 / Qwen3-Next's Hermes-style format, upstream's names): each call is
a JSON object `{"name": ..., "arguments": {...}}` between `<tool_call>` and `</tool_call>`, naming one
of the request's tools. The text outside the blocks is the message's content, as it comes, but for
the whitespace right after a call (the separators between calls). A block that is not such a call
(not JSON, an unknown name, or cut off before its closing tag) stays in the content as generated, so
nothing the model wrote is lost.

Streaming: text outside blocks streams as content (an end that may start `<tool_call>` is held back
until the next piece decides it); a call is sent whole, in one delta, once its block closes. Any
cutting of the answer into pieces gives what the whole answer gives.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from sglang.srt.entrypoints.openai.reasoning_parser import partial_marker_len

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
PARSERS = ("qwen", "qwen25")


class ToolCallParser:
    """One answer's split into content and calls: `feed` each new piece of text, then `finish`."""

    def __init__(self, tool_names: set[str] | None = None) -> None:
        """`tool_names`: the request's tools (None: any name)."""
        self.tool_names = tool_names
        self._buf = ""
        self.num_calls = 0
        self._after_call = False  # whitespace here is a separator: dropped

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(content, completed calls) that `text` completes."""
        self._buf += text
        content: list[str] = []
        calls: list[dict[str, Any]] = []
        while self._buf:
            start = self._buf.find(CALL_START)
            if start < 0:
                keep = partial_marker_len(self._buf, (CALL_START,))
                content.append(self._text(self._buf[: len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep :]
                break
            content.append(self._text(self._buf[:start]))
            self._buf = self._buf[start:]
            end = self._buf.find(CALL_END)
            if end < 0:
                break  # inside a block: wait for its end
            block = self._buf[: end + len(CALL_END)]
            self._buf = self._buf[end + len(CALL_END) :]
            call = self._call(block[len(CALL_START) : -len(CALL_END)])
            if call is None:
                content.append(self._text(block))
            else:
                calls.append(call)
                self._after_call = True
        return "".join(content), calls

    def _text(self, text: str) -> str:
        """Content text, less the whitespace that follows a call."""
        if self._after_call:
            text = text.lstrip()
            self._after_call = not text
        return text

    def finish(self) -> str:
        """What is held back once the answer is complete (an unclosed block stays text)."""
        text, self._buf = self._buf, ""
        return self._text(text)

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, calls = self.feed(text)
        return content + self.finish(), calls

    def _call(self, body: str) -> dict[str, Any] | None:
        """An OpenAI tool call from a block's JSON, or None if it is not a call."""
        try:
            obj = json.loads(body, parse_constant=_no_constant)
            name = obj.get("name") if isinstance(obj, dict) else None
            known = self.tool_names is None or name in self.tool_names
            if not isinstance(name, str) or not name or not known:
                return None
            args = obj.get("arguments", obj.get("parameters", {}))
            arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        except (ValueError, RecursionError):  # not JSON (NaN and Infinity are not), or nested past the stack
            return None
        call = {
            "index": self.num_calls,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": name, "arguments": arguments},
        }
        self.num_calls += 1
        return call


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
