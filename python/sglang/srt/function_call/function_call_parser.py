"""`--tool-call-parser` (upstream's flag): a chat answer's tool calls into `message.tool_calls`.

Both formats put each call between `<tool_call>` and `</tool_call>`, naming one of the request's tools:
- `qwen25` (alias `qwen`; Qwen2.5 / Qwen3 / Qwen3-Next's Hermes-style format, upstream's names): the
  block is a JSON object `{"name": ..., "arguments": {...}}`.
- `qwen3_coder` (Qwen3-Coder, Qwen3.5 and Qwen3.6's XML format, upstream's name): the block is
  `<function=NAME>` then `<parameter=KEY>VALUE</parameter>` per argument then `</function>`; a block may
  hold several functions. The XML is untyped: a value becomes the type the tool's JSON schema gives its
  parameter (`integer`, `number`, `boolean`, `object` or `array`, where the text parses as one; "null"
  is null), and a string otherwise, as upstream converts them. A value's one newline on each side (the
  chat template's layout) is not part of it. A closing tag the model leaves out ends where the next
  parameter, the function or the block does.

The text outside the blocks is the message's content, as it comes, but for the whitespace right after a
call (the separators between calls). A block that is not a call (not JSON or not such XML, an unknown
name, or cut off before its closing tag) stays in the content as generated, so nothing the model wrote
is lost.

Streaming: text outside blocks streams as content (an end that may start `<tool_call>` is held back
until the next piece decides it); a call is sent whole, in one delta, once its block closes. Any
cutting of the answer into pieces gives what the whole answer gives.
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping
from typing import Any

from sglang.srt.utils.text_markers import partial_marker_len

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
# --tool-call-parser name -> the block format it parses.
PARSERS = {"qwen": "json", "qwen25": "json", "qwen3_coder": "xml"}
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)(?:</function>|\Z)", re.S)
# A parameter's value ends at its closing tag, or where the next parameter starts, or at the end.
_PARAMETER = re.compile(r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.S)
_STRING_TYPES = {"string", "str", "text", "varchar", "char", "enum"}


class ToolCallParser:
    """One answer's split into content and calls: `feed` each new piece of text, then `finish`."""

    def __init__(self, tools: Mapping[str, Any] | None = None, parser: str = "qwen25") -> None:
        """`tools`: the request's tools, name -> the JSON schema of its parameters (None: any name,
        no schema); `parser`: the `--tool-call-parser` name."""
        self.tools = tools
        self.xml = PARSERS[parser] == "xml"
        self._buf = ""
        self._scanned = 0  # inside a block: how much of `_buf` holds no closing tag's start
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
            # Inside a block: search only what came since the last piece (a long call streams in many).
            end = self._buf.find(CALL_END, max(len(CALL_START), self._scanned - len(CALL_END) + 1))
            if end < 0:
                self._scanned = len(self._buf)
                break  # wait for its end
            self._scanned = 0
            block = self._buf[: end + len(CALL_END)]
            self._buf = self._buf[end + len(CALL_END) :]
            body = block[len(CALL_START) : -len(CALL_END)]
            arguments = self._block_calls(body)
            if arguments is None:
                content.append(self._text(block))
                continue
            calls += [self._call(name, args) for name, args in arguments]
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
        text, self._buf, self._scanned = self._buf, "", 0
        return self._text(text)

    def parse(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content, calls = self.feed(text)
        return content + self.finish(), calls

    def _block_calls(self, body: str) -> list[tuple[str, str]] | None:
        """[(name, JSON arguments)] of a block's calls, or None where the block is not calls."""
        found = _xml_calls(body) if self.xml else _json_call(body)
        if found is None or not all(self._known(name) for name, _ in found):
            return None
        try:
            return [(name, self._arguments(name, args)) for name, args in found]
        except (ValueError, RecursionError):  # not JSON (inf), or nested past the stack
            return None

    def _known(self, name: Any) -> bool:
        return isinstance(name, str) and bool(name) and (self.tools is None or name in self.tools)

    def _arguments(self, name: str, args: Any) -> str:
        """The call's arguments as a JSON string (XML values typed by the tool's schema first)."""
        if isinstance(args, str):
            return args
        if self.xml:
            schema = self.tools.get(name) if self.tools is not None else None
            props = schema.get("properties") if isinstance(schema, dict) else None
            props = props if isinstance(props, dict) else {}
            args = {key: _typed(value, props.get(key)) for key, value in args.items()}
        return json.dumps(args, ensure_ascii=False, allow_nan=False)  # 1e400 parses as inf: not JSON

    def _call(self, name: str, arguments: str) -> dict[str, Any]:
        call = tool_call(self.num_calls, name, arguments)
        self.num_calls += 1
        return call


def tool_call(index: int, name: str, arguments: str) -> dict[str, Any]:
    """A call as the chat reply carries it (`index`: its place in the answer, for streaming)."""
    return {
        "index": index,
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def _json_call(body: str) -> list[tuple[str, Any]] | None:
    """[(name, arguments)] of a `qwen25` block, or None if it is not a call."""
    try:
        obj = json.loads(body, parse_constant=_no_constant)  # NaN and Infinity are not JSON
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict):
        return None
    return [(obj.get("name"), obj.get("arguments", obj.get("parameters", {})))]


def _xml_calls(body: str) -> list[tuple[str, dict[str, str]]] | None:
    """[(name, {key: raw value})] of a `qwen3_coder` block's functions, or None if it is not made of
    functions alone."""
    calls, end = [], 0
    for match in _FUNCTION.finditer(body):
        if body[end : match.start()].strip():
            return None
        end = match.end()
        params, inner_end = {}, 0
        inner = match[2]
        for param in _PARAMETER.finditer(inner):
            if inner[inner_end : param.start()].strip():
                return None
            inner_end = param.end()
            params[param[1].strip()] = _strip_one_newline(param[2])
        if inner[inner_end:].strip():
            return None
        calls.append((match[1].strip(), params))
    if not calls or body[end:].strip():
        return None
    return calls


def _strip_one_newline(value: str) -> str:
    value = value[1:] if value.startswith("\n") else value
    return value[:-1] if value.endswith("\n") else value


def _typed(value: str, schema: Any) -> Any:
    """An XML value as the type its parameter's schema names (upstream's conversion), else the string."""
    if value.strip().lower() == "null":
        return None
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # ["integer", "null"]: the first that is not null
        kind = next((k for k in kind if k != "null"), None)
    kind = kind.lower() if isinstance(kind, str) else None
    if kind is None or kind in _STRING_TYPES:
        return value
    text = value.strip()
    if kind.startswith(("int", "uint", "long", "short", "unsigned")):
        try:
            return int(text)
        except ValueError:
            return value
    if kind.startswith(("num", "float", "double")):
        try:
            number = float(text)
        except ValueError:
            return value
        if not math.isfinite(number):
            return value
        return int(number) if number.is_integer() and not any(c in text for c in ".eE") else number
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(text.lower(), value)
    if kind in ("object", "array", "dict", "list"):
        try:
            parsed = json.loads(text, parse_constant=_no_constant)
            json.dumps(parsed, allow_nan=False)  # 1e400 parses as inf, which JSON has no word for
        except (ValueError, RecursionError):
            return value
        return parsed if isinstance(parsed, (dict, list)) else value
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")
