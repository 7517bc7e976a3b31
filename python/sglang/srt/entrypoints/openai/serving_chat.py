"""POST /v1/chat/completions: messages go through the model's chat template, then the native path."""

from __future__ import annotations

import inspect
import json
from typing import Any

from sglang.srt.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    ChoiceLogprobs,
    DeltaMessage,
)
from sglang.srt.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    finish_reason,
)
from sglang.srt.function_call.function_call_parser import ToolCallParser, tool_call
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import RequestError, auto_truncated
from sglang.srt.parser.reasoning_parser import (
    FORMATS,
    THINK_END,
    THINK_START,
    ReasoningParser,
    last_index,
    opens_at,
    prompt_opens_reasoning,
)


def chat_logprobs(meta: dict, start: int) -> ChoiceLogprobs:
    """Output tokens [start:] in the chat format (token text, logprob, UTF-8 bytes, top alternatives)."""
    entries = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:]
    content = []
    for k, (logprob, _tid, text) in enumerate(entries):
        top = tops[k] if k < len(tops) and tops[k] else []
        alternatives = [{"token": t[2], "logprob": t[0], "bytes": list(t[2].encode("utf-8"))} for t in top]
        content.append(
            {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8")), "top_logprobs": alternatives}
        )
    return ChoiceLogprobs.model_construct(content=content)


def _template_message(m: Any) -> dict[str, Any]:
    """A message as chat templates read it (OpenAI's shape: an assistant's calls, a tool's call id)."""
    message: dict[str, Any] = {"role": m.role, "content": m.text()}
    if m.image_urls() or m.video_urls():  # the parts: the template puts a placeholder at each image / video
        # A video part reaches the template as {"type": "video"}, the form Qwen-VL templates test for.
        message["content"] = [
            {"type": "video"} if p.type == "video_url" else p.model_dump(exclude_none=True) for p in m.content
        ]
    if m.tool_calls:
        # Arguments as a mapping: some templates (Qwen2.5's) `tojson` them, which would quote a string.
        message["tool_calls"] = [_template_call(c.model_dump(exclude_none=True)) for c in m.tool_calls]
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        message["name"] = m.name
    if m.reasoning_content is not None and m.role == "assistant":
        message["reasoning_content"] = m.reasoning_content
    return message


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return call  # not JSON: as sent
        if isinstance(parsed, dict):
            call["function"]["arguments"] = parsed
    return call


def forced_tool_calls(text: str) -> list[dict[str, Any]] | None:
    """The calls of an answer a forcing tool_choice constrained (`forced_tool_schema`: a JSON array of
    {"name", "parameters"}), in the shape of the parser's calls; None if the text is not such an array
    (cut off by max_tokens)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and "name" in i for i in items):
        return None
    return [
        tool_call(k, item["name"], json.dumps(item.get("parameters", {}), ensure_ascii=False))
        for k, item in enumerate(items)
    ]


def _template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools the template shows the model (none with tool_choice "none", as upstream)."""
    if not req.tools or req.tool_choice == "none":
        return None
    return [t.model_dump(exclude_none=True) for t in req.tools]


def template_arguments(tokenizer: Any) -> set[str]:
    """The named parameters of the tokenizer's `apply_chat_template`."""
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}


class OpenAIServingChat(OpenAIServingBase):
    request_model = ChatCompletionRequest
    response_model = ChatCompletionResponse
    stream_response_model = ChatCompletionStreamResponse
    id_prefix = "chatcmpl-"
    param_names = {
        "input_ids": "messages",
        "sampling_params.max_new_tokens": "max_tokens",
        "sampling_params.min_new_tokens": "min_tokens",
        "top_logprobs_num": "top_logprobs",
    }

    def __init__(
        self,
        tokenizer_manager,
        model_name: str,
        sampling_defaults: dict[str, Any] | None = None,
        reasoning_parser: str | None = None,
        tool_call_parser: str | None = None,
        template_defaults: dict[str, Any] | None = None,
        include_usage: bool = False,
    ):
        """`sampling_defaults`: sampling_params for the fields a request leaves unset (the model's
        recommendation, `model_sampling_defaults`); `reasoning_parser`, `tool_call_parser`: the flags;
        `template_defaults`: --default-chat-template-kwargs (a request's chat_template_kwargs win, key by
        key)."""
        super().__init__(tokenizer_manager, model_name, include_usage)
        self.sampling_defaults = dict(sampling_defaults or {})
        self.template_defaults = dict(template_defaults or {})
        self.reasoning_format = FORMATS[reasoning_parser] if reasoning_parser else None
        self.tool_call_parser = tool_call_parser

    async def apply_chat_template(self, req: ChatCompletionRequest) -> list[int]:
        """The prompt's token ids. With `continue_final_message` and an assistant message last, as
        upstream: the template renders the messages before it with the generation prompt, and that
        message's text follows as the answer's beginning (otherwise the flag changes nothing)."""
        tokenizer = self.tm.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("This model has no chat template; use /v1/completions.", "messages")
        messages = [_template_message(m) for m in req.messages]
        prefix = ""
        if req.continue_final_message and messages[-1]["role"] == "assistant":
            prefix = messages.pop()["content"]
        thinking = {} if req.reasoning_effort is None else {"enable_thinking": req.reasoning_effort != "none"}
        variables = {**self.template_defaults, **thinking, **(req.chat_template_kwargs or {})}
        # Only the template's own variables: not apply_chat_template's arguments (`chat_template`
        # would let a request render a template of its own on the server, `tools` would pass by the
        # request's own field and its checks).
        named = sorted(set(variables) & template_arguments(tokenizer))
        if named:
            raise RequestError(
                f"chat_template_kwargs.{named[0]} is an argument of the chat template call, not a "
                "template variable.",
                "chat_template_kwargs",
            )
        shown = _template_tools(req)
        tools = {"tools": shown} if shown else {}
        try:
            prompt = tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True, **tools, **variables
            )
        except Exception as e:  # a template may refuse a role order or a role (jinja raise_exception)
            raise RequestError(f"The chat template rejected the messages: {e}", "messages") from None
        fmt = self.reasoning_format
        if fmt is not None:
            req._continues_message = bool(prefix.strip())
            # Only the template's own tail counts (a message may mention <think>). It takes a second
            # rendering, needless where the answer starts in the reasoning anyway, or no think tag is
            # anywhere (the answer's split and its grammar's start both read it).
            if fmt.always_reasoning:  # (its models may leave the opening tag out: a continued message may close it)
                req._prompt_opens_reasoning = prompt_opens_reasoning(prefix, always=True)
            elif THINK_START in prompt + prefix:
                try:
                    base = tokenizer.apply_chat_template(
                        messages, tokenize=False, add_generation_prompt=False, **tools, **variables
                    )
                except Exception:  # noqa: BLE001 - a template that needs the generation prompt: all of it
                    base = ""
                tail = prompt[len(base) :] if prompt.startswith(base) else prompt
                req._prompt_opens_reasoning = prompt_opens_reasoning(tail + prefix)
        media = any(m.image_urls() or m.video_urls() for m in req.messages)  # (--allow-auto-truncate: no cut)
        return await self.tm.encode(prompt + prefix, "messages", add_special_tokens=False, truncate=not media)

    async def to_generate_input(self, req: ChatCompletionRequest) -> GenerateReqInput:
        input_ids = req.input_ids if req.input_ids is not None else await self.apply_chat_template(req)
        media = req.input_ids is None
        if not media:
            input_ids = self._pretokenized(req, input_ids)
        sampling_params = req.sampling_params()
        # Without max_tokens / max_completion_tokens an answer runs to its end or the context length,
        # as upstream's chat (the native default, 128 tokens, is /generate's).
        if "max_new_tokens" not in sampling_params:
            room = self.tm.limits.context_len - len(input_ids)
            sampling_params["max_new_tokens"] = room
            if sampling_params.get("min_new_tokens", 0) > room:  # as the native default does
                sampling_params["min_new_tokens"] = room
        for name, value in self.sampling_defaults.items():  # --sampling-defaults model
            sampling_params.setdefault(name, value)
        return GenerateReqInput(
            input_ids=input_ids,
            sampling_params=sampling_params,
            rid=req.rid,
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            return_text_in_logprobs=True,
            stream=req.stream,
            image_data=media and [url for m in req.messages for url in m.image_urls()] or None,
            video_data=media and [url for m in req.messages for url in m.video_urls()] or None,
            return_prompt_token_ids=req.return_prompt_token_ids or req.return_token_ids,
            # A grammar (and --enable-strict-thinking) applies after the reasoning the answer starts in.
            require_reasoning=self.reasoning_format is not None
            and not req.forces_tool_calls
            and req._prompt_opens_reasoning,
            **req.passthrough_fields(),
        )

    def _pretokenized(self, req: ChatCompletionRequest, ids: list[int]) -> list[int]:
        """Upstream's `input_ids`: the prompt as the client rendered and tokenized it (a 400 with media:
        the template places their tokens), cut as --allow-auto-truncate cuts a prompt; whether it leaves a
        think block open is read from its think tags' token ids (the whole prompt's last of each)."""
        if any(m.image_urls() or m.video_urls() for m in req.messages):
            message = "input_ids is the whole prompt, with no place for the messages' images or videos: send "
            raise RequestError(message + "those without input_ids.", "input_ids")
        limits = self.tm.limits
        if getattr(limits, "auto_truncate", False):
            ids = auto_truncated(ids, limits, "input_ids")
        fmt = self.reasoning_format
        if fmt is not None:
            encode = self.tm.tokenizer.encode
            start, end = (last_index(ids, encode(tag, add_special_tokens=False)) for tag in (THINK_START, THINK_END))
            req._prompt_opens_reasoning = opens_at(start, end, fmt.always_reasoning)
        return ids

    def _reasoning_parser(self, req: ChatCompletionRequest) -> ReasoningParser | None:
        # (A forced call leaves the answer no room for reasoning: its grammar starts at the first token.)
        if self.reasoning_format is None or not req.separate_reasoning or req.forces_tool_calls:
            return None
        return ReasoningParser(self.reasoning_format, req._prompt_opens_reasoning, req._continues_message)

    def make_choice(self, req: ChatCompletionRequest, index: int, out: dict) -> ChatChoice:
        reason, matched = finish_reason(out["meta_info"])
        message = AssistantMessage(content=out["text"])
        parser = self._reasoning_parser(req)
        if parser is not None:
            reasoning, content = parser.parse(out["text"])
            message = AssistantMessage(content=content or None, reasoning_content=reasoning or None)
        if req.forces_tool_calls:
            calls = forced_tool_calls(out["text"])
            if calls is not None:
                for call in calls:
                    del call["index"]  # (a streaming field)
                message.content, message.tool_calls = None, calls
                reason = "tool_calls" if reason == "stop" else reason
        elif self._parses_tools(req):
            content, calls = self._tool_call_parser(req).parse(message.content or "")
            calls = calls if req.parallel_tool_calls else calls[:1]
            if calls:
                for call in calls:
                    del call["index"]  # (a streaming field)
                message.content, message.tool_calls = content or None, calls
                reason = "tool_calls" if reason == "stop" else reason
        return ChatChoice(
            index=index,
            message=message,
            logprobs=chat_logprobs(out["meta_info"], 0) if req.logprobs else None,
            finish_reason=reason,
            matched_stop=matched,
            **self.hidden_states_field(req, out["meta_info"]),
            **token_fields(req, out),
        )

    def opening_choice(self, index: int) -> ChatStreamChoice:
        # OpenAI's first chunk of a choice carries the role only.
        return ChatStreamChoice(index=index, delta=DeltaMessage(role="assistant", content=""))

    def stream_choices(
        self, req: ChatCompletionRequest, index: int, delta: str, meta: dict, progress: dict
    ) -> list[ChatStreamChoice]:
        """As upstream (and OpenAI), the finish reason comes in a choice of its own with an empty delta,
        after the last text."""
        choice = self.stream_choice(req, index, delta, meta, progress)
        if choice is None or choice.finish_reason is None:
            return [] if choice is None else [choice]
        finishing = self._finishing_choices(choice)
        return finishing + self.hidden_states_choices(req, index, meta, finishing)

    def hidden_states_choice(self, index: int, states: list) -> ChatStreamChoice:
        return ChatStreamChoice(index=index, delta=DeltaMessage(hidden_states=states))

    def _finishing_choices(self, choice: ChatStreamChoice) -> list[ChatStreamChoice]:
        index = choice.index
        ending = ChatStreamChoice(
            index=index,
            delta=DeltaMessage(),
            finish_reason=choice.finish_reason,
            matched_stop=choice.matched_stop,
        )
        d = choice.delta
        if (
            d.content is None
            and d.reasoning_content is None
            and d.tool_calls is None
            and not (choice.logprobs and choice.logprobs.content)
        ):
            return [ending]
        choice.finish_reason = choice.matched_stop = None
        return [choice, ending]

    def answer_parsers(self, req: ChatCompletionRequest) -> tuple[ReasoningParser | None, ToolCallParser | None]:
        """Fresh parsers for one answer of `req`, those its route runs (None where it runs none)."""
        tools = self._tool_call_parser(req) if self._parses_tools(req) else None
        return self._reasoning_parser(req), tools

    def _parses_tools(self, req: ChatCompletionRequest) -> bool:
        return self.tool_call_parser is not None and bool(req.tools) and req.tool_choice != "none"

    def _tool_call_parser(self, req: ChatCompletionRequest) -> ToolCallParser:
        tools = {t.function.name: t.function.parameters for t in req.tools}
        return ToolCallParser(tools, self.tool_call_parser)

    def _split_tool_calls(
        self, req: ChatCompletionRequest, index: int, content: str, last: bool, progress: dict
    ) -> tuple[str, list[dict[str, Any]]]:
        """(content, completed calls) of a choice's new content; its parser lives in `progress`."""
        parser = progress.get(("tools", index))
        if parser is None:
            parser = progress[("tools", index)] = self._tool_call_parser(req)
        content, calls = parser.feed(content)
        if last:
            content += parser.finish()
        if not req.parallel_tool_calls:  # (at most one: the first)
            sent = progress.get(("calls", index), 0)
            calls = calls[: max(0, 1 - sent)]
            progress[("calls", index)] = sent + len(calls)
        return content, calls

    def _split_reasoning(
        self, req: ChatCompletionRequest, index: int, delta: str, last: bool, progress: dict
    ) -> tuple[str, str]:
        """(reasoning, content) of a choice's new text; the choice's parser lives in `progress`. With
        stream_reasoning false the reasoning is held until it ends (or the answer does)."""
        parser = progress.get(("reasoning", index))
        if parser is None:
            parser = progress[("reasoning", index)] = self._reasoning_parser(req)
        reasoning, content = parser.feed(delta)
        if last:
            more_reasoning, more_content = parser.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if not req.stream_reasoning:
            held = progress.get(("held", index), "") + reasoning
            if parser.in_reasoning and not last:
                progress[("held", index)] = held
                return "", content
            progress[("held", index)], reasoning = "", held
        return reasoning, content

    def stream_choice(
        self, req: ChatCompletionRequest, index: int, delta: str, meta: dict, progress: dict
    ) -> ChatStreamChoice | None:
        logprobs = None
        if req.logprobs:
            logprobs = chat_logprobs(meta, progress.get(index, 0))
            progress[index] = progress.get(index, 0) + len(logprobs.content)
        reason, matched = finish_reason(meta)
        reasoning, calls = "", []
        if req.forces_tool_calls:
            # The calls go out once the answer (a JSON array) is complete; a cut-off one as content.
            held = progress[("forced", index)] = progress.get(("forced", index), "") + delta
            delta = ""
            if reason is not None:
                calls = forced_tool_calls(held)
                delta = held if calls is None else ""
                reason = "tool_calls" if reason == "stop" and calls else reason
                calls = calls or []
        elif self.reasoning_format is not None and req.separate_reasoning:
            reasoning, delta = self._split_reasoning(req, index, delta, reason is not None, progress)
        if self._parses_tools(req) and not req.forces_tool_calls:
            delta, calls = self._split_tool_calls(req, index, delta, reason is not None, progress)
            if reason == "stop" and progress[("tools", index)].num_calls:
                reason = "tool_calls"
        if not (delta or reasoning or calls or reason or (logprobs and logprobs.content)):
            return None
        return ChatStreamChoice(
            index=index,
            delta=DeltaMessage(
                content=delta or None, reasoning_content=reasoning or None, tool_calls=calls or None
            ),
            logprobs=logprobs,
            finish_reason=reason,
            matched_stop=matched,
        )


def token_fields(req: ChatCompletionRequest, out: dict) -> dict[str, Any]:
    """A choice's token-in token-out fields, as upstream's: where the request asked for them."""
    fields: dict[str, Any] = {}
    if req.return_prompt_token_ids or req.return_token_ids:
        fields["prompt_token_ids"] = out["prompt_token_ids"]
    if req.return_token_ids:
        fields["response_token_ids"] = out["output_ids"]
    if req.return_meta_info:
        fields["meta_info"] = out["meta_info"]
    return fields
