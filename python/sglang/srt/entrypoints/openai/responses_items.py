"""The items of the Responses API and the chat messages they stand for.

Input items become chat messages for the model's template: a message (roles user, system, developer,
assistant; text and image parts), `function_call` (an assistant's tool call: consecutive calls, and the
assistant text before them, make one assistant message), `function_call_output` (a tool message), and
`reasoning` (the next assistant message's `reasoning_content`, which templates such as Qwen3's render for
the turns after the last user message). A developer message is a system message, as upstream renders it.

An answer (the chat route's message) becomes output items in OpenAI's order: `reasoning`, `message`
(`output_text`), `function_call`s. Ids are random, as OpenAI's: `resp_`, `msg_`, `rs_`, `fc_`, `call_`.
"""

from __future__ import annotations

import base64
import binascii
import json
import uuid
import zlib
from typing import Any

from sglang.srt.managers.request_validation import RequestError

TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
INPUT_ITEMS = ("message", "function_call", "function_call_output", "custom_tool_call", "custom_tool_call_output",
               "reasoning")  # fmt: skip
CUSTOM_INPUT = "input"  # (responses_protocol.CUSTOM_PARAMETERS' one property)
# A reasoning item's `encrypted_content` (with include ["reasoning.encrypted_content"], for a client that
# stores nothing and sends the items back): the text compressed and base64-encoded, not encrypted (this
# server holds no key); a blob without this prefix is someone else's, and ignored.
REASONING_BLOB = "sglang-hybrid-reasoning-1."


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _fail(index: int, message: str, field: str = "") -> RequestError:
    return RequestError(f"input[{index}]{field}: {message}.", f"input[{index}]{field}")


def _parts(index: int, content: Any, field: str = ".content") -> str | list[dict[str, Any]]:
    """A message's content (or a call output) as the chat route takes it: a string, or text and image_url
    parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(index, f"{field[1:]} must be a string or a list of parts", field)
    parts: list[dict[str, Any]] = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        where = f"{field}[{k}]"
        if kind in TEXT_PARTS:
            text = part.get("refusal" if kind == "refusal" else "text")
            if not isinstance(text, str):
                raise _fail(index, f"a part of type {kind!r} needs a string", where)
            parts.append({"type": "text", "text": text})
        elif kind == "input_image":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise _fail(index, "an input_image part needs image_url (file_id is not served)", where)
            parts.append({"type": "image_url", "image_url": {"url": url}})
        else:
            raise _fail(index, f"part type {kind!r} is not one of {', '.join(TEXT_PARTS)}, input_image", where)
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)  # (plain text: what every template renders)
    return parts


def input_messages(
    items: str | list[dict[str, Any]], offset: int = 0, max_reasoning_chars: int = 1 << 24
) -> list[dict[str, Any]]:
    """The chat messages of input items (a RequestError naming `input[i - offset]` for a bad item: the
    first `offset` items are a stored conversation's). `max_reasoning_chars`: the most reasoning text
    the items' `encrypted_content` blobs may hold together."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []
    budget = [max_reasoning_chars]

    def assistant(new_turn: bool = False) -> dict[str, Any]:
        """The assistant message the next text, call or pending reasoning joins: the last message if it is
        the assistant's (and not `new_turn`), else a new one."""
        last = messages[-1] if messages else None
        if last is None or last["role"] != "assistant" or new_turn:
            last = {"role": "assistant", "content": None}
            messages.append(last)
        if reasoning:
            last["reasoning_content"] = (last.get("reasoning_content") or "") + "".join(reasoning)
            reasoning.clear()
        return last

    for n, item in enumerate(items):
        i = n - offset
        if not isinstance(item, dict):
            raise _fail(i, "an item must be an object")
        kind = item.get("type", "message")
        turn_ends = kind in ("function_call_output", "custom_tool_call_output") or (
            kind == "message" and item.get("role") != "assistant"
        )
        if reasoning and turn_ends:  # reasoning no answer followed (a turn cut short): a turn of its own
            assistant(new_turn=True)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise _fail(i, f"role {role!r} is not one of user, system, developer, assistant", ".role")
            content = _parts(i, item.get("content"))
            if role == "assistant":
                if not isinstance(content, str):
                    raise _fail(i, "an assistant message's parts are text", ".content")
                last = messages[-1] if messages else {}
                message = assistant(new_turn=bool(last.get("tool_calls")))  # text after calls: a new turn
                message["content"] = (message["content"] or "") + content
            else:
                messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind in ("function_call", "custom_tool_call"):
            field = "arguments" if kind == "function_call" else "input"
            name, call_id, arguments = item.get("name"), item.get("call_id"), item.get(field, "{}")
            if not (isinstance(name, str) and isinstance(call_id, str) and isinstance(arguments, str)):
                raise _fail(i, f"a {kind} needs name, call_id and {field} (strings)")
            if kind == "custom_tool_call":  # the call as the model made it (`custom_tool_input`)
                arguments = json.dumps({CUSTOM_INPUT: arguments}, ensure_ascii=False)
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
            assistant().setdefault("tool_calls", []).append(call)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str | list):
                raise _fail(i, f"a {kind} needs call_id (a string) and output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": _parts(i, output, ".output")})
        elif kind == "reasoning":
            reasoning.append(_reasoning_text(i, item, budget))
        else:
            raise _fail(i, f"item type {kind!r} is not one of {', '.join(INPUT_ITEMS)}", ".type")
    return messages


def _reasoning_text(i: int, item: dict[str, Any], budget: list[int]) -> str:
    """A reasoning item's text: its content's (else its summary's) reasoning_text parts, else what its
    encrypted_content holds (counted against `budget`, the characters left to restore)."""
    for field in ("content", "summary"):
        parts = item.get(field) or []
        if not isinstance(parts, list):
            raise _fail(i, f"a reasoning item's {field} is a list of parts", f".{field}")
        for k, part in enumerate(parts):
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                raise _fail(i, "a part needs text, a string", f".{field}[{k}]")
        if parts:
            return "".join(p["text"] for p in parts)
    text = decode_reasoning(item.get("encrypted_content"), budget[0])
    if text is None:
        return ""
    budget[0] -= len(text)
    if budget[0] < 0:
        raise _fail(i, "the reasoning the items' encrypted_content holds is longer than a prompt can be",
                    ".encrypted_content")  # fmt: skip
    return text


def encode_reasoning(text: str) -> str:
    return REASONING_BLOB + base64.urlsafe_b64encode(zlib.compress(text.encode())).decode()


def decode_reasoning(blob: Any, max_chars: int) -> str | None:
    """The text of one of this server's blobs (None for another's); at most 4 x `max_chars` + 4 bytes
    are decompressed (a longer text is cut there, and the caller refuses it)."""
    if not isinstance(blob, str) or not blob.startswith(REASONING_BLOB):
        return None
    try:
        packed = base64.urlsafe_b64decode(blob[len(REASONING_BLOB) :])
        return zlib.decompressobj().decompress(packed, 4 * max_chars + 4).decode(errors="replace")
    except (binascii.Error, ValueError, zlib.error):
        return None


def tool_call_item(call: dict[str, Any], custom: set[str] = frozenset()) -> dict[str, Any]:
    """A parsed call (the chat route's) as a function_call item, or a custom_tool_call for a custom tool."""
    name, arguments = call["function"]["name"], call["function"]["arguments"]
    if name not in custom:
        return call_item(new_id("fc"), call["id"], name, arguments)
    return {"id": new_id("ctc"), "type": "custom_tool_call", "call_id": call["id"], "name": name,
            "input": custom_tool_input(arguments), "status": "completed"}  # fmt: skip


def custom_tool_input(arguments: str) -> str:
    """A custom tool's input from the arguments the model wrote ({"input": text}; else as written)."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments
    value = parsed.get(CUSTOM_INPUT) if isinstance(parsed, dict) else None
    return value if isinstance(value, str) else arguments


def reasoning_item(item_id: str, text: str, status: str, blob: bool = False) -> dict[str, Any]:
    content = [{"type": "reasoning_text", "text": text}] if text else []
    item = {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}
    if blob:
        item["encrypted_content"] = encode_reasoning(text)
    return item


def output_text(text: str, logprobs: list[dict[str, Any]] | None) -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return part


def message_item(item_id: str, text: str | None, status: str, logprobs: list | None = None) -> dict[str, Any]:
    content = [] if text is None else [output_text(text, logprobs)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}  # fmt: skip


def stored_input_items(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A request's input as stored items, each with an id (`GET /v1/responses/{id}/input_items`, and
    the conversation a next turn continues)."""
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": items}]}]
    out = []
    for item in items:
        if not isinstance(item, dict):
            out.append(item)  # (input_messages refuses it, naming it)
            continue
        item = dict(item, type=item.get("type", "message"))
        if item["type"] == "message" and isinstance(item.get("content"), str):
            kind = "output_text" if item.get("role") == "assistant" else "input_text"
            item["content"] = [{"type": kind, "text": item["content"]}]
        prefix = {"message": "msg", "function_call": "fc", "reasoning": "rs"}.get(item["type"], "item")
        item.setdefault("id", new_id(prefix))
        item.setdefault("status", "completed")
        out.append(item)
    return out
