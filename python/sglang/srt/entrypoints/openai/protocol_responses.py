"""OpenAI-compatible response models (pydantic), with OpenAI's field names; the request models are in
`protocol.py`, which re-exports these (upstream keeps both in one module, and callers import them there)."""

from __future__ import annotations

import time
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field, SerializationInfo, model_serializer


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class UsageInfo(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class ChoiceLogprobs(_Response):
    """A chat choice's logprobs: `content` holds OpenAI's token entries as plain dicts (`token`, `logprob`,
    `bytes`, `top_logprobs` of `token`, `logprob`, `bytes`), written by orjson in one piece: pydantic's
    serializer holds the GIL through a whole list (0.4-0.8 s at the entry bound), so a reply built on a
    worker thread still stalled the event loop. `model_dump` gives an `orjson.Fragment` for this field,
    which orjson writes as it is (every reply goes through `json_response` or `sse`); `model_dump_json`
    and `model_dump(mode="json")` give the plain form."""

    content: list[dict[str, Any]]

    @model_serializer(mode="wrap")
    def _as_json(self, handler: Any, info: SerializationInfo) -> Any:
        if info.mode == "python":  # (what json_response and sse write, with orjson)
            return orjson.Fragment(orjson.dumps({"content": self.content}))
        return handler(self)  # (model_dump_json, model_dump(mode="json"): the plain form)


class CompletionLogprobs(_Response):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class CompletionResponse(_Response):
    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class AssistantMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # with --reasoning-parser, as upstream
    tool_calls: list[dict[str, Any]] | None = None  # with --tool-call-parser


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # a call whole, when its block closes

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: Any) -> dict[str, Any]:
        # OpenAI's deltas carry only what changed: no `"role": null` after the first chunk.
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    matched_stop: int | str | None = None


class ChatCompletionStreamResponse(_Response):
    id: str
    object: str = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "sglang"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(_Response):
    object: str = "list"
    data: list[ModelCard]
