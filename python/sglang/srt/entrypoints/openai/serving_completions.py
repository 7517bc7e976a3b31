"""POST /v1/completions: OpenAI's legacy completions API on the native generate path."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sglang.srt.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
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


def completion_logprobs(
    meta: dict, start: int, offset: int, with_top: bool
) -> tuple[CompletionLogprobs, int]:
    """Logprobs of output tokens [start:] in the completions format; returns the text offset after them."""
    entries = meta.get("output_token_logprobs", [])[start:]
    tops = meta.get("output_top_logprobs", [])[start:]
    lp = CompletionLogprobs()
    for k, (logprob, _tid, text) in enumerate(entries):
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob)
        lp.text_offset.append(offset)
        offset += len(text)
        if with_top:
            top = tops[k] if k < len(tops) and tops[k] else []
            lp.top_logprobs.append({t[2]: t[0] for t in top})
        else:
            lp.top_logprobs.append(None)
    return lp, offset


class OpenAIServingCompletion(OpenAIServingBase):
    request_model = CompletionRequest
    param_names = {
        "text": "prompt",
        "input_ids": "prompt",
        "sampling_params.max_new_tokens": "max_tokens",
        "sampling_params.min_new_tokens": "min_tokens",
        "top_logprobs_num": "logprobs",
    }

    def to_generate_input(self, req: CompletionRequest) -> GenerateReqInput:
        p = req.prompt
        is_text = isinstance(p, str) or all(isinstance(x, str) for x in p)
        return GenerateReqInput(
            text=p if is_text else None,
            input_ids=None if is_text else p,
            sampling_params=req.sampling_params(),
            rid=req.rid,
            return_logprob=req.logprobs is not None,
            top_logprobs_num=req.logprobs or 0,
            return_text_in_logprobs=True,
            stream=req.stream,
        )

    def build_response(self, req: CompletionRequest, obj: GenerateReqInput, first: Any) -> CompletionResponse:
        outs = as_list(first)
        choices = []
        for i, out in enumerate(outs):
            reason, matched = finish_reason(out["meta_info"])
            logprobs = None
            if req.logprobs is not None:
                logprobs, _ = completion_logprobs(out["meta_info"], 0, 0, req.logprobs > 0)
            choices.append(
                CompletionChoice(
                    index=i, text=out["text"], logprobs=logprobs, finish_reason=reason, matched_stop=matched
                )
            )
        return CompletionResponse(
            id=f"cmpl-{outs[0]['meta_info']['id']}",
            model=self.model_name,
            choices=choices,
            usage=UsageInfo(**usage(outs, req.n)),
        )

    async def stream_events(
        self, req: CompletionRequest, obj: GenerateReqInput, first: Any, gen: AsyncIterator[Any]
    ) -> AsyncIterator[bytes]:
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        offsets: dict[int, int] = {}
        last: dict[int, dict] = {}
        stream_id = f"cmpl-{first['meta_info']['id']}"
        chunk = first
        while chunk is not None:
            i = chunk.get("index", 0)
            meta = chunk["meta_info"]
            delta = chunk["text"][sent_text.get(i, 0) :]
            sent_text[i] = len(chunk["text"])
            logprobs = None
            if req.logprobs is not None:
                start = sent_lp.get(i, 0)
                logprobs, offsets[i] = completion_logprobs(meta, start, offsets.get(i, 0), req.logprobs > 0)
                sent_lp[i] = start + len(logprobs.tokens)
            reason, matched = finish_reason(meta)
            if delta or reason or (logprobs and logprobs.tokens):
                choice = CompletionChoice(
                    index=i, text=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched
                )
                yield sse(CompletionResponse(id=stream_id, model=self.model_name, choices=[choice]))
            last[i] = chunk
            chunk = await anext(gen, None)
        if req.include_usage:
            outs = [last[i] for i in sorted(last)]
            yield sse(
                CompletionResponse(
                    id=stream_id, model=self.model_name, choices=[], usage=UsageInfo(**usage(outs, req.n))
                )
            )
