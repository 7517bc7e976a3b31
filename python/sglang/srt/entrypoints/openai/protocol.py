"""OpenAI-compatible request and response models (pydantic), with OpenAI's field names (the responses'
are defined in `protocol_responses.py` and importable from here, upstream's path).

Requests are validated straight from the JSON body in pydantic's lax mode, as upstream's models are (what
upstream takes, we take: `5.0` or `"5"` for an integer, `true` for a count of 1; `5.5` or `"five"` is
refused); a failure becomes a `RequestError` naming the field (`request_error_from_validation`).
Unknown fields are ignored, as OpenAI clients send vendor extensions.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    StrictInt,
    ValidationInfo,
    field_validator,
    model_validator,
)

from sglang.srt.constrained.grammar_spec import json_error
from sglang.srt.entrypoints.openai.protocol_errors import (  # noqa: F401 - re-exported: the routes import it here
    _field_error,
    request_error_from_validation,
)
from sglang.srt.entrypoints.openai.protocol_responses import (  # noqa: F401 - upstream's import path
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    UsageInfo,
)
from sglang.srt.sampling.sampling_params import MAX_N

MAX_TOP_LOGPROBS = 20


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_regex: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(None, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id -> bias (sampling_params.logit_bias)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    min_tokens: int | None = Field(None, ge=0)
    user: str | None = None
    rid: str | None = None
    # Upstream's: the request's priority (--enable-priority-scheduling; see GenerateReqInput).
    priority: StrictInt | None = None  # (true, "7" or 3.0 are a 400, as on /generate)
    # Constrained decoding (upstream's extensions beside OpenAI's response_format): at most one of them.
    regex: str | None = None
    ebnf: str | None = None
    json_schema: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    # Prefill/decode disaggregation: added by sglang-router's PD mode (see GenerateReqInput).
    bootstrap_host: str | None = None
    bootstrap_port: int | None = None
    bootstrap_room: int | None = Field(None, ge=0)
    # Prefix-cache namespaces (upstream's; `cache_salt` is vLLM's name): see GenerateReqInput.
    cache_salt: str | None = None
    extra_key: str | None = None
    # Upstream's: the choice's `hidden_states` is the last position's (--enable-return-hidden-states).
    return_hidden_states: bool = False
    # Upstream's: CustomLogitProcessor.to_str() and its settings (--enable-custom-logit-processor).
    custom_logit_processor: str | None = None
    custom_params: dict[str, Any] | None = None
    # Upstream's: the LoRA adapter to run with, by name (a `model` of "base:adapter" wins over it).
    lora_path: str | None = None
    # Upstream's routing replay: served on /generate and Engine.generate only (a 400 here, below).
    return_routed_experts: bool = False

    @field_validator("return_routed_experts")
    @classmethod
    def _routed_experts_on_generate_only(cls, value: bool) -> bool:
        if value:
            raise _field_error(
                "return_routed_experts",
                "served on /generate and Engine.generate only (meta_info.routed_experts), not on the OpenAI "
                "routes",
                "unsupported_parameter",
            )
        return value

    def passthrough_fields(self) -> dict[str, Any]:
        """The GenerateReqInput fields passed as they are: PD's bootstrap, the cache namespace,
        return_hidden_states, custom_logit_processor and priority."""
        return {
            "return_hidden_states": self.return_hidden_states,
            "custom_logit_processor": self.custom_logit_processor,
            "bootstrap_host": self.bootstrap_host,
            "bootstrap_port": self.bootstrap_port,
            "bootstrap_room": self.bootstrap_room,
            "cache_salt": self.cache_salt,
            "extra_key": self.extra_key,
            "priority": self.priority,
        }

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int | None) -> int | None:
        if v is not None and v != -1 and v < 1:
            raise ValueError("top_k must be -1 (disabled) or a positive integer")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        items = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in items):
            raise ValueError("stop strings must be non-empty")
        return v

    # The grammar the request's fields ask for: (sampling_params field, text), and the field of this API
    # it came from (what an error about it names: `grammar_origin`).
    _grammar: tuple[str, str] | None = PrivateAttr(default=None)
    _grammar_origin: str | None = PrivateAttr(default=None)

    @property
    def grammar_origin(self) -> str | None:
        return self._grammar_origin

    @model_validator(mode="after")
    def _grammar_fields(self) -> _SamplingFields:
        """At most one grammar (response_format, regex, ebnf, json_schema): a 400 naming the field. The
        scheduler parses and compiles it (`constrained/grammar_spec.py` says why not here)."""
        extras = [(name, getattr(self, name)) for name in ("regex", "ebnf", "json_schema")]
        asked = [(name, v) for name, v in extras if v is not None]
        if self.response_format is not None:
            grammar = grammar_of_response_format(self.response_format)
            if grammar is not None:
                asked.insert(0, ("response_format", grammar))
        if len(asked) > 1:
            raise _field_error(asked[1][0], f"{asked[1][0]} cannot be set together with {asked[0][0]}")
        if asked:
            name, value = asked[0]
            kind, text = value if name == "response_format" else (name, value)
            if not isinstance(text, str):
                text = json.dumps(text)
            elif (message := json_error(kind, text)) is not None:
                raise _field_error(name, message)
            self._grammar, self._grammar_origin = (kind, text), name
        return self

    def sampling_params(self) -> dict[str, Any]:
        """The native sampling_params (None = server default)."""
        d = {
            "max_new_tokens": self.max_tokens,
            "min_new_tokens": self.min_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "n": self.n,
            "stop": self.stop,
            "stop_regex": self.stop_regex,
            "stop_token_ids": self.stop_token_ids,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "logit_bias": self.logit_bias,
            "ignore_eos": self.ignore_eos,
            "no_stop_trim": self.no_stop_trim,
            "skip_special_tokens": self.skip_special_tokens,
            "custom_params": self.custom_params,
        }
        if self._grammar is not None:
            d[self._grammar[0]] = self._grammar[1]
        return {k: v for k, v in d.items() if v is not None}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def grammar_of_response_format(rf: dict[str, Any]) -> tuple[str, Any] | None:
    """The grammar (sampling_params field, value) an OpenAI `response_format` asks for, as upstream maps
    it: json_schema -> its `json_schema.schema`, json_object -> any JSON object, structural_tag -> the
    tag itself; text (or no type) -> None."""
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return "json_schema", '{"type": "object"}'
    if kind == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema", spec.get("schema_")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict | bool):
            message = "a json_schema response_format needs json_schema.schema, a JSON schema object"
            raise _field_error("response_format", message)
        return "json_schema", schema
    if kind == "structural_tag":
        return "structural_tag", rf
    raise _field_error(
        "response_format",
        f"response_format type {kind!r} is not one of text, json_object, json_schema, structural_tag",
    )


class CompletionRequest(_SamplingFields):
    prompt: Any
    max_tokens: int | None = Field(16, ge=0)  # (0 with echo: the prompt's logprobs only, as lm-eval asks)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    # Upstream's token-in token-out: each choice's `token_ids` (streamed: the new ones in each chunk) and
    # `prompt_token_ids` (streamed: in its first chunk).
    return_token_ids: bool = False
    _echoed: list[str] = PrivateAttr(default_factory=list)  # (set by the route: each prompt's text)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str):
            return v
        if isinstance(v, list) and v:
            if all(isinstance(x, str) for x in v) or ids(v) or all(ids(x) and x for x in v):
                return v
        raise ValueError(
            "prompt must be a string, a list of strings, a list of token ids or a list of lists of token ids"
        )

    @model_validator(mode="after")
    def _unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise _field_error("suffix", "suffix is not supported")
        if self.best_of not in (None, self.n):
            raise _field_error("best_of", "best_of different from n is not supported")
        return self


class ImageUrl(_Request):
    url: str  # a data URI or base64 (remote URLs are refused: multimodal/processor.py)
    detail: str | None = None


class ContentPart(_Request):
    type: Literal["text", "image_url", "video_url"]
    text: str | None = None
    image_url: ImageUrl | None = None
    # {"url": a video file as a data URI, base64 or an http(s) URL}: one video_data item
    video_url: ImageUrl | None = None


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(_Request):
    """A call an earlier assistant message made (a conversation's history)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"] = "function"
    function: FunctionSpec


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # Required but for assistant messages (upstream's protocol: those may carry tool calls instead).
    content: str | list[ContentPart] | None = Field(None, validate_default=True)
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message's answer to that call
    # An earlier answer's reasoning (upstream passes it to the template: Qwen3's renders it for the turns
    # after the last user message, a tool-calling loop's).
    reasoning_content: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind not in ("text", "image_url", "video_url"):
                    raise ValueError(
                        f"content part {i} has type {kind!r}; only 'text', 'image_url' and 'video_url' parts "
                        "are supported"
                    )
                value = part.get(kind)
                if kind == "text" and not isinstance(value, str):
                    raise ValueError(f"content part {i} of type 'text' needs a string 'text'")
                if kind in ("image_url", "video_url") and not (
                    isinstance(value, dict) and isinstance(value.get("url"), str)
                ):
                    raise ValueError(f"content part {i} of type '{kind}' needs '{kind}': {{'url': ...}}")
        return v

    @field_validator("content", mode="after")
    @classmethod
    def _content_required(cls, v: Any, info: ValidationInfo) -> Any:
        role = info.data.get("role")
        if v is None and role is not None and role != "assistant":
            raise ValueError(f"a {role} message needs content (a string or a list of text parts)")
        return v

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content if p.type == "text")
        return self.content or ""

    def image_urls(self) -> list[str]:
        """The message's images, in order (`image_data` items)."""
        if not isinstance(self.content, list):
            return []
        return [p.image_url.url for p in self.content if p.type == "image_url"]

    def video_urls(self) -> list[str]:
        """The message's videos, in order (`video_data` items)."""
        if not isinstance(self.content, list):
            return []
        return [p.video_url.url for p in self.content if p.type == "video_url"]


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Function calling, as upstream: the tools go to the chat template, and with --tool-call-parser the
    # answer's calls come back parsed. "required" and a named function constrain the answer to a JSON
    # array of calls (`forced_tool_schema`), which comes back as the calls.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True  # false: at most one call (forced: by the grammar; else the first)
    # Upstream's extensions: extra variables for the chat template (e.g. `enable_thinking`), and
    # continuing the last message when it is the assistant's (its text is the answer's beginning).
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    # OpenAI's (upstream's mapping): "none" turns the template's thinking off (enable_thinking: false),
    # any other effort on, unless chat_template_kwargs says; no token budget follows from it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | float | None = None
    # Upstream's token-in token-out extensions (RL rollouts), whole answers only: each choice's
    # `prompt_token_ids`, `response_token_ids` (its output ids as sampled) and `meta_info` (the native
    # reply's); and `input_ids`, the prompt's ids as they are, in place of the template's rendering.
    return_prompt_token_ids: bool = False
    return_token_ids: bool = False
    return_meta_info: bool = False
    input_ids: list[StrictInt] | None = None  # (as /generate's: true or "7" is not a token id)
    # Upstream's, with --reasoning-parser: split the answer's reasoning into `reasoning_content`
    # (false: the text as generated), and stream it as it comes (false: in one piece when it ends).
    separate_reasoning: bool = True
    stream_reasoning: bool = True
    # Set by the chat serving: whether the generation prompt leaves a think block open, and whether the
    # answer continues a final message's text.
    _prompt_opens_reasoning: bool = PrivateAttr(default=False)
    _continues_message: bool = PrivateAttr(default=False)

    @field_validator("reasoning_effort", mode="before")
    @classmethod
    def _effort(cls, v: Any) -> Any:
        if isinstance(v, bool):  # (pydantic would take false for 0.0)
            raise ValueError("reasoning_effort must be a level (none, low, ...) or a number, not a boolean")
        return v

    @model_validator(mode="after")
    def _checks(self) -> ChatCompletionRequest:
        effort = self.reasoning_effort
        if isinstance(effort, float) and not 0 <= effort <= 0.99:  # (upstream's range)
            raise _field_error("reasoning_effort", "reasoning_effort must be a level or a number in [0, 0.99]")
        for name in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
            if getattr(self, name) and self.stream:  # (upstream's words)
                raise _field_error(name, f"{name} is not supported with streaming. Please set stream=false when using {name}=true")  # fmt: skip
        if self.top_logprobs and not self.logprobs:
            raise _field_error("top_logprobs", "top_logprobs needs logprobs set to true")
        if self.forces_tool_calls:
            if self._grammar is not None:
                message = f"tool_choice cannot force a call together with {self._grammar[0]}"
                raise _field_error("tool_choice", message)
            schema = forced_tool_schema(self.tools or [], self.tool_choice)
            if not self.parallel_tool_calls:
                schema["maxItems"] = 1
            self._grammar = "json_schema", json.dumps(schema)
            self._grammar_origin = "tools"  # (what fails to compile is a tool's parameters schema)
        # OpenAI's newer name wins over the older one, as upstream (`max_completion_tokens or max_tokens`).
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self

    @property
    def forces_tool_calls(self) -> bool:
        """tool_choice "required" or a named function: the answer is calls only."""
        return self.tool_choice not in (None, "none", "auto")


def forced_tool_schema(tools: list[Tool], choice: str | dict[str, Any]) -> dict[str, Any]:
    """The JSON schema of the answer a forcing tool_choice allows, upstream's: an array of calls
    {"name": ..., "parameters": {...}}, at least one of any tool for "required", exactly one of the
    named tool for {"type": "function", "function": {"name": ...}}."""

    def call(tool: Tool) -> dict[str, Any]:
        parameters = tool.function.parameters or {"type": "object", "properties": {}}
        return {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": parameters,
            },
            "required": ["name", "parameters"],
        }

    if not tools:
        raise _field_error("tool_choice", "tool_choice forces a call, and the request has no tools")
    if choice == "required":
        return {"type": "array", "minItems": 1, "items": {"anyOf": [call(t) for t in tools]}}
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type", "function") != "function" or not isinstance(name, str):
        message = 'a named tool_choice is {"type": "function", "function": {"name": ...}}'
        raise _field_error("tool_choice", message)
    tool = next((t for t in tools if t.function.name == name), None)
    if tool is None:
        message = f"tool_choice names {name!r}, which is not one of the request's tools"
        raise _field_error("tool_choice", message)
    return {"type": "array", "minItems": 1, "maxItems": 1, "items": call(tool)}
