"""POST /v1/messages (Anthropic's Messages API, as upstream SGLang serves it for any chat model): the
request model, and its translation into a chat completion request, which the chat serving runs (template,
reasoning and tool-call parsers, grammars for a forced tool_choice).

Content blocks: a user message's `text`, `image` (a base64 or URL source) and `tool_result` blocks (each a
tool message, before the message's own text), an assistant message's `text`, `thinking` (the message's
`reasoning_content`, which Qwen3's template renders for a tool-calling loop), `redacted_thinking`
(dropped: it holds nothing this server can read) and `tool_use` (its calls). `system` (a string or text
blocks) is a first system message. `thinking` ({"type": "enabled" | "disabled"}) sets the template's
`enable_thinking` unless the request's `chat_template_kwargs` does (Qwen3 and Qwen3.5's switch); its
`budget_tokens` becomes the thinking budget (`custom_params.thinking_budget`, unless the request sets
one), which the server enforces under --enable-strict-thinking (upstream accepts it and ignores it).
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, request_error_from_validation
from sglang.srt.entrypoints.openai.serving_base import reword
from sglang.srt.managers.request_validation import RequestError

# The chat route's own fields a Messages request may also send (upstream's extensions), passed as they are.
CHAT_EXTENSIONS = (
    "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos",
    "min_tokens", "skip_special_tokens", "chat_template_kwargs", "separate_reasoning", "priority", "lora_path",
    "rid", "cache_salt", "extra_key", "stop_regex", "custom_params", "custom_logit_processor", "regex", "ebnf",
    "json_schema", "response_format",
)  # fmt: skip
# A chat field's name in this API (Anthropic's errors carry a message only: it names the field).
CHAT_TO_MESSAGES = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}


def _reword(message: str) -> str:
    """A chat route's message in this API's field names, and its tool_choice shape in Anthropic's."""
    message = reword(message, CHAT_TO_MESSAGES)
    return message.replace('{"type": "function", "function": {"name": ...}}', '{"type": "tool", "name": ...}')


USER_BLOCKS = ("text", "image", "tool_result")
ASSISTANT_BLOCKS = ("text", "thinking", "redacted_thinking", "tool_use")


class Tool(BaseModel):
    """A client tool (Anthropic's: name, description, input_schema); server tools have a `type`."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object"})
    type: str | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError('a tool_choice of type "tool" needs the name of one of the request\'s tools')
        return self


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # the chat extensions are read from the extras

    model: str | None = None
    messages: list[dict[str, Any]] = Field(min_length=1)
    max_tokens: int = Field(ge=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        """null for `stream`: its default, as Anthropic's."""
        if isinstance(data, dict) and "stream" in data and data["stream"] is None:
            data = {k: v for k, v in data.items() if k != "stream"}
        return data

    @field_validator("tools")
    @classmethod
    def _client_tools(cls, tools: list[Tool] | None) -> list[Tool] | None:
        for i, tool in enumerate(tools or []):
            if any(t.name == tool.name for t in (tools or [])[:i]):
                raise ValueError(f"tools[{i}] is named {tool.name!r}, as an earlier tool is")
            if tool.type not in (None, "custom"):
                raise ValueError(
                    f"tools[{i}] is a server tool ({tool.type!r}); this server runs none, only the client's own "
                    "tools (name, description, input_schema)"
                )
        return tools

    def chat_request(self, count_only: bool = False) -> ChatCompletionRequest:
        """The chat completion request that answers this one (a RequestError in this API's names)."""
        body: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items() if k in CHAT_EXTENSIONS}
        body.update(
            model=self.model,
            messages=self._messages(),
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop_sequences or None,
            stream=self.stream and not count_only,
        )
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": {"name": t.name, "description": t.description,
                                                  "parameters": t.input_schema}}
                for t in self.tools
            ]  # fmt: skip
            choice = self.tool_choice.type if self.tool_choice else "auto"
            named = {"type": "function", "function": {"name": self.tool_choice.name}} if choice == "tool" else None
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(choice, named)
            body["parallel_tool_calls"] = not (self.tool_choice and self.tool_choice.disable_parallel_tool_use)
        elif self.tool_choice is not None and self.tool_choice.type in ("any", "tool"):
            raise RequestError("tool_choice: it forces a tool call, and the request has no tools.", "tool_choice")
        enabled = (self.thinking or {}).get("type")
        kwargs = body.get("chat_template_kwargs")
        if enabled in ("enabled", "disabled") and isinstance(kwargs or {}, dict):  # (else chat's 400 names it)
            body["chat_template_kwargs"] = {"enable_thinking": enabled == "enabled", **(kwargs or {})}
        budget, custom = (self.thinking or {}).get("budget_tokens"), body.get("custom_params")
        if enabled == "enabled" and isinstance(budget, int) and not isinstance(budget, bool) and budget >= 0:
            if isinstance(custom or {}, dict):  # (else chat's 400 names it)
                body["custom_params"] = {"thinking_budget": budget, **(custom or {})}
        last = body["messages"][-1] if body["messages"] else {}
        if last.get("role") == "assistant":  # Anthropic's prefill: the answer goes on from its text
            if last.get("tool_calls") or last.get("reasoning_content") or not isinstance(last.get("content"), str):
                where = f"messages[{len(self.messages) - 1}]"
                raise _fail(where, "a final assistant message (a prefill) is text only, without tool_use or thinking")
            body["continue_final_message"] = True
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            err = request_error_from_validation(e)
            param = (err.param or "").partition("[")[0]
            raise RequestError(_reword(err.message), CHAT_TO_MESSAGES.get(param, err.param), err.code) from None

    def _messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.system:
            system = self.system if isinstance(self.system, str) else _text_blocks(self.system, "system")
            out.append({"role": "system", "content": system})
        for i, message in enumerate(self.messages):
            out += _message(i, message)
        return out


def _fail(where: str, message: str) -> RequestError:
    return RequestError(f"{where}: {message}.", where)


def _text_blocks(blocks: list[Any], where: str) -> str:
    texts = []
    for k, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise _fail(f"{where}[{k}]", "a text block ({'type': 'text', 'text': ...}) is expected here")
        texts.append(block["text"])
    return "\n".join(texts)


def _image(where: str, source: Any) -> dict[str, Any]:
    if isinstance(source, dict) and source.get("type") == "base64" and isinstance(source.get("data"), str):
        url = f"data:{source.get('media_type') or 'image/png'};base64,{source['data']}"
    elif isinstance(source, dict) and source.get("type") == "url" and isinstance(source.get("url"), str):
        url = source["url"]
    else:
        raise _fail(f"{where}.source", "an image source is {'type': 'base64', 'media_type', 'data'} or "
                    "{'type': 'url', 'url'}")  # fmt: skip
    return {"type": "image_url", "image_url": {"url": url}}


def _content(where: str, blocks: Any) -> str | list[dict[str, Any]]:
    """A tool result's content: a string, or text and image blocks."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _fail(where, "a tool result's content is a string or a list of text and image blocks")
    parts = []
    for k, block in enumerate(blocks):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image(f"{where}[{k}]", block.get("source")))
        else:
            raise _fail(f"{where}[{k}]", "a tool result's blocks are text and image blocks")
    if all(p["type"] == "text" for p in parts):
        return "\n".join(p["text"] for p in parts)
    return parts


def _message(i: int, message: Any) -> list[dict[str, Any]]:
    """The chat messages of messages[i]: a user message's tool results first (tool messages), then its
    text and images; an assistant message's text, thinking and calls as one message."""
    where = f"messages[{i}]"
    if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
        raise _fail(f"{where}.role", "role is user or assistant")
    role, content = message["role"], message.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise _fail(f"{where}.content", "content is a string or a list of content blocks")
    allowed = USER_BLOCKS if role == "user" else ASSISTANT_BLOCKS
    tools, parts, thinking, calls = [], [], [], []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind not in allowed:
            raise _fail(f"{at}.type", f"a {role} message's blocks are {', '.join(allowed)}, not {kind!r}")
        if kind == "text":
            if not isinstance(block.get("text"), str):
                raise _fail(f"{at}.text", "a text block needs text, a string")
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image":
            parts.append(_image(at, block.get("source")))
        elif kind == "tool_result":
            if not isinstance(block.get("tool_use_id"), str):
                raise _fail(f"{at}.tool_use_id", "a tool_result needs tool_use_id, a string")
            result = _content(f"{at}.content", block.get("content", ""))
            if block.get("is_error"):  # (the model is told the tool failed)
                result = f"Error: {result}" if isinstance(result, str) else [{"type": "text", "text": "Error:"}, *result]
            tools.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
        elif kind == "thinking":
            if not isinstance(block.get("thinking"), str):
                raise _fail(f"{at}.thinking", "a thinking block needs thinking, a string")
            thinking.append(block["thinking"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise _fail(at, "a tool_use block needs id and name, strings")
            try:  # (orjson refuses nesting past 254 levels: a 400, where json's recursion was a 500)
                arguments = orjson.dumps(block.get("input") or {}).decode()
            except orjson.JSONEncodeError as e:
                raise _fail(f"{at}.input", f"the input cannot be written as JSON ({e})") from None
            calls.append({"id": block["id"], "type": "function", "function": {"name": block["name"],
                                                                               "arguments": arguments}})  # fmt: skip
    out: list[dict[str, Any]] = list(tools)
    text_only = all(p["type"] == "text" for p in parts)
    body: Any = "".join(p["text"] for p in parts) if text_only else parts
    if role == "assistant":
        assistant: dict[str, Any] = {"role": "assistant", "content": body or None}
        if thinking:
            assistant["reasoning_content"] = "".join(thinking)
        if calls:
            assistant["tool_calls"] = calls
        out.append(assistant)
    elif parts or not tools:
        out.append({"role": "user", "content": body})
    return out
