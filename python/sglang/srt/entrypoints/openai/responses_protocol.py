"""POST /v1/responses: the request model (OpenAI's Responses API, as upstream SGLang serves it for any chat
model) and its translation into a chat completion request, which the chat serving runs (template, tool and
reasoning parsers, grammars). The items of `input` and `output` are translated in `responses_items.py`.

Accepted as OpenAI defines them: `input` (a string or a list of items), `instructions`, function `tools`,
`tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p`, `top_logprobs`,
`include` (`message.output_text.logprobs`), `text.format` (text, json_object, json_schema), `stream`,
`store`, `previous_response_id`, `background`, `metadata` (OpenAI's bounds: 16 keys of at most 64
characters, values of at most 512), `user`, `truncation`, `reasoning` (its `effort` as chat's
`reasoning_effort`), `service_tier`, `prompt_cache_key`,
`safety_identifier`; and the chat route's extensions (`top_k`, `min_p`, penalties, `seed`, `stop`, ...).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sglang.srt.entrypoints.openai.protocol import (
    MAX_TOP_LOGPROBS,
    ChatCompletionRequest,
    _field_error,
    request_error_from_validation,
)
from sglang.srt.entrypoints.openai.serving_base import reword
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import ServerAbortError

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# What `include` may name: the logprobs, and items this server's outputs never have (nothing to add).
KNOWN_INCLUDES = {
    LOGPROBS_INCLUDE,
    "reasoning.encrypted_content",
    "message.input_image.image_url",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
}
# The chat route's own fields a Responses request may also send (upstream's extensions), passed as they are.
CHAT_EXTENSIONS = (
    "top_k", "min_p", "stop", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "logit_bias", "ignore_eos", "min_tokens", "skip_special_tokens", "no_stop_trim",
    "chat_template_kwargs", "separate_reasoning", "priority", "lora_path", "rid", "cache_salt", "extra_key",
    "stop_regex", "custom_params", "custom_logit_processor", "return_hidden_states", "bootstrap_host",
    "bootstrap_port", "bootstrap_room",
)  # fmt: skip
# A chat field's name in this API (for the chat request's validation errors).
CHAT_TO_RESPONSES = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
# OpenAI's fields for what this server does not have: a 400 naming them, not a silent answer without them.
NOT_SERVED = {
    "conversation": "OpenAI's Conversations API is not served; continue with previous_response_id "
    "(--enable-response-store) or send the conversation's items in input",
    "prompt": "stored prompt templates are not served; send the instructions and input themselves",
}
# A custom tool's one parameter, as the model sees the tool.
CUSTOM_INPUT = "input"
CUSTOM_PARAMETERS = {
    "type": "object",
    "properties": {CUSTOM_INPUT: {"type": "string", "description": "The tool's input, free-form text."}},
    "required": [CUSTOM_INPUT],
}


def _custom_description(description: str | None, fmt: Any) -> str | None:
    """A custom tool's description, with its grammar (if any) described for the model."""
    parts = [description] if description else []
    if isinstance(fmt, dict) and fmt.get("type") == "grammar":
        parts.append(f"The input follows this {fmt.get('syntax') or 'lark'} grammar:\n{fmt.get('definition', '')}")
    return "\n\n".join(parts) or None


class FunctionTool(BaseModel):
    """A Responses function tool: flat, unlike chat's {"type", "function": {...}}."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["function"]
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # the chat extensions are read from the extras

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _nulls(cls, data: Any) -> Any:
        """OpenAI takes null for these switches: their defaults."""
        if isinstance(data, dict):
            nulls = [k for k in ("stream", "store", "background", "parallel_tool_calls") if data.get(k, 0) is None]
            data = {k: v for k, v in data.items() if k not in nulls}
            for field, why in NOT_SERVED.items():
                if data.get(field) not in (None, "", [], {}):
                    raise _field_error(field, why, "unsupported_parameter")
        return data

    @field_validator("input")
    @classmethod
    def _input(cls, v: Any) -> Any:
        if isinstance(v, list) and not v:
            raise ValueError("input must be a string or a non-empty list of items")
        return v

    @field_validator("include")
    @classmethod
    def _include(cls, v: list[str] | None) -> list[str] | None:
        unknown = sorted(set(v or []) - KNOWN_INCLUDES)
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not one of {', '.join(sorted(KNOWN_INCLUDES))}")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is None:
            return v
        if len(v) > MAX_METADATA_KEYS:
            raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(v)}")
        for key, value in v.items():
            if len(key) > MAX_METADATA_KEY or len(value) > MAX_METADATA_VALUE:
                raise ValueError(
                    f"keys of at most {MAX_METADATA_KEY} characters and values of at most {MAX_METADATA_VALUE}"
                )
        return v

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or bool(self.top_logprobs)

    def function_tools(self) -> list[FunctionTool]:
        """The request's tools as the model sees them: function tools, and custom tools (free-form text
        input, OpenAI's `custom`) as functions of one string parameter `input` (upstream's shim; a
        custom tool's grammar is described to the model, not enforced); a 400 names any other type."""
        tools = []
        for i, tool in enumerate(self.tools or []):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if kind not in ("function", "custom"):
                raise RequestError(
                    f"tools[{i}]: type {kind!r} is not supported; this server runs no built-in tools (web "
                    "search, file search, code interpreter, MCP), only function and custom tools the client "
                    "runs.",
                    f"tools[{i}].type",
                )
            try:
                fn = FunctionTool.model_validate(dict(tool, type="function"))
            except ValidationError as e:
                err = request_error_from_validation(e)
                raise RequestError(f"tools[{i}].{err.message}", f"tools[{i}].{err.param}") from None
            if any(t.name == fn.name for t in tools):
                raise RequestError(f"tools[{i}].name: {fn.name!r} names an earlier tool too.", f"tools[{i}].name")
            if kind == "custom":
                fn.parameters = CUSTOM_PARAMETERS
                fn.description = _custom_description(fn.description, tool.get("format"))
            tools.append(fn)
        return tools

    def custom_tool_names(self) -> set[str]:
        return {t.get("name") for t in self.tools or [] if isinstance(t, dict) and t.get("type") == "custom"}

    def echoed_tools(self) -> list[dict[str, Any]]:
        """The tools as a reply echoes them (custom tools as the request gave them)."""
        names = self.custom_tool_names()
        return [
            {"type": "custom", "name": t.name, "description": (self.tools[i] or {}).get("description"),
             "format": (self.tools[i] or {}).get("format") or {"type": "text"}}
            if t.name in names else t.model_dump()
            for i, t in enumerate(self.function_tools())
        ]  # fmt: skip

    def chat_tool_choice(self) -> Any:
        """tool_choice in the chat route's shape ({"type": "function", "name"} -> {"function": {"name"}})."""
        choice = self.tool_choice
        if not isinstance(choice, dict):
            return choice
        if choice.get("type") not in ("function", "custom") or not isinstance(choice.get("name"), str):
            raise RequestError(
                'tool_choice: a named tool_choice is {"type": "function" or "custom", "name": ...} (other tool '
                "types are not served).",
                "tool_choice",
            )
        return {"type": "function", "function": {"name": choice["name"]}}

    def response_format(self) -> dict[str, Any] | None:
        """text.format in the chat route's response_format shape."""
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
            raise RequestError(
                "text.format: type must be one of text, json_object, json_schema.", "text.format"
            )
        if fmt["type"] != "json_schema":
            return {"type": fmt["type"]}
        if not isinstance(fmt.get("schema"), dict):
            raise RequestError("text.format: a json_schema format needs schema, a JSON schema object.", "text.format")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}

    def reasoning_effort(self) -> str | None:
        """`reasoning.effort`, as chat's `reasoning_effort` (a level: OpenAI's Responses API has no number)."""
        effort = (self.reasoning or {}).get("effort")
        if effort is not None and not isinstance(effort, str):
            raise RequestError("reasoning.effort must be a level (none, minimal, low, medium, high).", "reasoning.effort")
        return effort

    def chat_request(self, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat completion request that answers this one (a RequestError in this API's names)."""
        tools = self.function_tools()
        body: dict[str, Any] = {k: v for k, v in (self.model_extra or {}).items() if k in CHAT_EXTENSIONS}
        body.update(
            model=self.model,
            messages=messages,
            max_tokens=self.max_output_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            stream=self.stream,
            logprobs=self.wants_logprobs,
            top_logprobs=self.top_logprobs,
            user=self.user,
            response_format=self.response_format(),
            reasoning_effort=self.reasoning_effort(),
        )
        if tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in tools]  # fmt: skip
            body["tool_choice"] = self.chat_tool_choice()
            body["parallel_tool_calls"] = self.parallel_tool_calls
        elif self.tool_choice not in (None, "none", "auto"):
            raise RequestError("tool_choice forces a call, and the request has no function tools.", "tool_choice")
        try:
            return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
        except ValidationError as e:
            raise responses_error(request_error_from_validation(e)) from None


def _reword(message: str) -> str:
    """A chat route's message in this API's field names (word by word: "messages" -> "input", ...)."""
    message = reword(message, CHAT_TO_RESPONSES)
    return message.replace("input input", "input")  # ("The messages input (N tokens) ...")


def responses_error(err: RequestError) -> RequestError:
    """A chat route's error in this API's field names."""
    param = err.param or ""
    head = param.partition("[")[0]
    new = CHAT_TO_RESPONSES.get(head, head) + param[len(head) :] if param else err.param
    return RequestError(_reword(err.message), new, err.code)


def responses_abort(err: ServerAbortError) -> ServerAbortError:
    """A grammar the scheduler refused, named by this API's field (`text.format`, not response_format)."""
    new = CHAT_TO_RESPONSES.get(err.param or "", err.param)
    return ServerAbortError(err.status_code, _reword(err.message), new)
