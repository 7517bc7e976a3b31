"""POST /v1/completions: OpenAI's legacy completions API on the native generate path."""

from __future__ import annotations

from sglang.srt.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from sglang.srt.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    finish_reason,
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
    response_model = CompletionResponse
    stream_response_model = CompletionResponse
    id_prefix = "cmpl-"
    param_names = {
        "text": "prompt",
        "input_ids": "prompt",
        "sampling_params.max_new_tokens": "max_tokens",
        "sampling_params.min_new_tokens": "min_tokens",
        "top_logprobs_num": "logprobs",
    }

    async def to_generate_input(self, req: CompletionRequest) -> GenerateReqInput:
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
            **req.passthrough_fields(),
        )

    def make_choice(self, req: CompletionRequest, index: int, out: dict) -> CompletionChoice:
        reason, matched = finish_reason(out["meta_info"])
        logprobs = None
        if req.logprobs is not None:
            logprobs, _ = completion_logprobs(out["meta_info"], 0, 0, req.logprobs > 0)
        return CompletionChoice(
            index=index, text=out["text"], logprobs=logprobs, finish_reason=reason, matched_stop=matched,
            **self.hidden_states_field(req, out["meta_info"]),
        )  # fmt: skip

    def stream_choice(
        self, req: CompletionRequest, index: int, delta: str, meta: dict, progress: dict
    ) -> CompletionChoice | None:
        logprobs = None
        if req.logprobs is not None:
            sent, offset = progress.get(index, (0, 0))
            logprobs, offset = completion_logprobs(meta, sent, offset, req.logprobs > 0)
            progress[index] = (sent + len(logprobs.tokens), offset)
        reason, matched = finish_reason(meta)
        if not (delta or reason or (logprobs and logprobs.tokens)):
            return None
        return CompletionChoice(
            index=index, text=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched
        )

    def hidden_states_choice(self, index: int, states: list) -> CompletionChoice:
        return CompletionChoice(index=index, text="", hidden_states=states)
