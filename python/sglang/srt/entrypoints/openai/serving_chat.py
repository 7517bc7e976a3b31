"""POST /v1/chat/completions: messages go through the model's chat template, then the native path."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sglang.srt.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    ChatTokenLogprob,
    ChoiceLogprobs,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from sglang.srt.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    as_list,
    finish_reason,
    sse,
    usage,
)
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import RequestError


def chat_logprobs(meta: dict, start: int) -> ChoiceLogprobs:
    """Output tokens [start:] in the chat format (token text, logprob, UTF-8 bytes, top alternatives)."""
    entries = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:]
    content = []
    for k, (logprob, _tid, text) in enumerate(entries):
        top = tops[k] if k < len(tops) and tops[k] else []
        content.append(
            ChatTokenLogprob(
                token=text,
                logprob=logprob,
                bytes=list(text.encode("utf-8")),
                top_logprobs=[
                    TopLogprob(token=t[2], logprob=t[0], bytes=list(t[2].encode("utf-8"))) for t in top
                ],
            )
        )
    return ChoiceLogprobs(content=content)


class OpenAIServingChat(OpenAIServingBase):
    request_model = ChatCompletionRequest
    param_names = {
        "text": "messages",
        "input_ids": "messages",
        "sampling_params.max_new_tokens": "max_tokens",
        "sampling_params.min_new_tokens": "min_tokens",
        "top_logprobs_num": "top_logprobs",
    }

    def apply_chat_template(self, req: ChatCompletionRequest) -> list[int]:
        tokenizer = self.tm.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise RequestError("This model has no chat template; use /v1/completions.", "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # a template may refuse a role order or a role (jinja raise_exception)
            raise RequestError(f"The chat template rejected the messages: {e}", "messages") from None
        return tokenizer.encode(prompt, add_special_tokens=False)

    def to_generate_input(self, req: ChatCompletionRequest) -> GenerateReqInput:
        return GenerateReqInput(
            input_ids=self.apply_chat_template(req),
            sampling_params=req.sampling_params(),
            rid=req.rid,
            return_logprob=req.logprobs,
            top_logprobs_num=req.top_logprobs or 0,
            return_text_in_logprobs=True,
            stream=req.stream,
        )

    def build_response(
        self, req: ChatCompletionRequest, obj: GenerateReqInput, first: Any
    ) -> ChatCompletionResponse:
        outs = as_list(first)
        choices = []
        for i, out in enumerate(outs):
            reason, matched = finish_reason(out["meta_info"])
            choices.append(
                ChatChoice(
                    index=i,
                    message=AssistantMessage(content=out["text"]),
                    logprobs=chat_logprobs(out["meta_info"], 0) if req.logprobs else None,
                    finish_reason=reason,
                    matched_stop=matched,
                )
            )
        return ChatCompletionResponse(
            id=f"chatcmpl-{outs[0]['meta_info']['id']}",
            model=self.model_name,
            choices=choices,
            usage=UsageInfo(**usage(outs, req.n)),
        )

    async def stream_events(
        self, req: ChatCompletionRequest, obj: GenerateReqInput, first: Any, gen: AsyncIterator[Any]
    ) -> AsyncIterator[bytes]:
        stream_id = f"chatcmpl-{first['meta_info']['id']}"
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        last: dict[int, dict] = {}

        def event(choice: ChatStreamChoice) -> bytes:
            return sse(ChatCompletionStreamResponse(id=stream_id, model=self.model_name, choices=[choice]))

        chunk = first
        while chunk is not None:
            i = chunk.get("index", 0)
            meta = chunk["meta_info"]
            if i not in sent_text:
                # OpenAI's first chunk of a choice carries the role only.
                sent_text[i] = 0
                yield event(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
            delta = chunk["text"][sent_text[i] :]
            sent_text[i] = len(chunk["text"])
            logprobs = None
            if req.logprobs:
                logprobs = chat_logprobs(meta, sent_lp.get(i, 0))
                sent_lp[i] = sent_lp.get(i, 0) + len(logprobs.content)
            reason, matched = finish_reason(meta)
            if delta or reason or (logprobs and logprobs.content):
                yield event(
                    ChatStreamChoice(
                        index=i,
                        delta=DeltaMessage(content=delta or None),
                        logprobs=logprobs,
                        finish_reason=reason,
                        matched_stop=matched,
                    )
                )
            last[i] = chunk
            chunk = await anext(gen, None)
        if req.include_usage:
            outs = [last[i] for i in sorted(last)]
            yield sse(
                ChatCompletionStreamResponse(
                    id=stream_id, model=self.model_name, choices=[], usage=UsageInfo(**usage(outs, req.n))
                )
            )
