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
    meta: dict, start: int, offset: int, with_top: bool, kind: str = "output", lp: CompletionLogprobs | None = None
) -> tuple[CompletionLogprobs, int]:
    """Logprobs of output (or input) tokens [start:] in the completions format, after `lp`'s; returns the
    text offset after them."""
    entries = meta.get(f"{kind}_token_logprobs", [])[start:]
    tops = meta.get(f"{kind}_top_logprobs", [])[start:]
    lp = CompletionLogprobs() if lp is None else lp
    for k, (logprob, _tid, text) in enumerate(entries):
        lp.tokens.append(text)
        lp.token_logprobs.append(logprob)
        lp.text_offset.append(offset)
        offset += len(text)
        if with_top and logprob is not None:  # (a prompt's first token has no prediction: null, as OpenAI)
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
        if req.echo:
            # The prompts' text each choice's answer begins with: what runs, tokenized here (and cut as
            # --allow-auto-truncate cuts it), decoded (as upstream: token-id prompts decoded too).
            single = isinstance(p, str) or not isinstance(p[0], list | str)
            ids = [await self._prompt_ids(x) for x in ([p] if single else p)]
            req._echoed = [self.tm.tokenizer.decode(x) for x in ids]
            p, is_text = (ids[0] if single else ids), False
        return GenerateReqInput(
            text=p if is_text else None,
            input_ids=None if is_text else p,
            sampling_params=req.sampling_params(),
            rid=req.rid,
            return_logprob=req.logprobs is not None,
            # With echo the prompt's own logprobs too (its first token has none), as OpenAI's echo gives.
            logprob_start_len=0 if req.echo and req.logprobs is not None else -1,
            top_logprobs_num=req.logprobs or 0,
            return_text_in_logprobs=True,
            stream=req.stream,
            return_prompt_token_ids=req.return_token_ids,
            **req.passthrough_fields(),
        )

    async def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return await self.tm.encode(prompt, "prompt", truncate=True)
        limits = self.tm.limits
        return prompt[: limits.max_req_input_len] if limits.auto_truncate else prompt  # (else checked later)

    def _echo(self, req: CompletionRequest, index: int, meta: dict) -> tuple[str, CompletionLogprobs | None, int]:
        """With echo: choice `index`'s prompt text, its tokens' logprobs (where asked), and the offset after
        it (the answer's first: the whole prompt's length; inside the prompt each token's offset adds the
        tokens' own texts, which a character split across tokens makes longer)."""
        if not req.echo:
            return "", None, 0
        text = req._echoed[index // req.n]
        if req.logprobs is None:
            return text, None, len(text)
        logprobs, _ = completion_logprobs(meta, 0, 0, req.logprobs > 0, "input")
        return text, logprobs, len(text)

    def make_choice(self, req: CompletionRequest, index: int, out: dict) -> CompletionChoice:
        reason, matched = finish_reason(out["meta_info"])
        echoed, logprobs, offset = self._echo(req, index, out["meta_info"])
        if req.logprobs is not None:
            logprobs, _ = completion_logprobs(out["meta_info"], 0, offset, req.logprobs > 0, lp=logprobs)
        return CompletionChoice(
            index=index, text=echoed + out["text"], logprobs=logprobs, finish_reason=reason, matched_stop=matched,
            **self.hidden_states_field(req, out["meta_info"]),
            **({"token_ids": out["output_ids"], "prompt_token_ids": out["prompt_token_ids"]} if req.return_token_ids else {}),
        )  # fmt: skip

    def stream_choice(
        self, req: CompletionRequest, index: int, delta: str, meta: dict, progress: dict
    ) -> CompletionChoice | None:
        logprobs, echoed, ids = None, "", {}
        if index not in progress:  # the choice's first chunk: with echo, the prompt comes first
            echoed, logprobs, offset = self._echo(req, index, meta)
            progress[index] = (0, offset)
            if req.return_token_ids:
                ids["prompt_token_ids"] = progress[("chunk", index)]["prompt_token_ids"]
        if req.return_token_ids:  # (the chunk's ids are cumulative: the new ones go)
            output_ids = progress[("chunk", index)]["output_ids"]
            ids["token_ids"] = output_ids[progress.get(("ids", index), 0) :]
            progress[("ids", index)] = len(output_ids)
        if req.logprobs is not None:
            sent, offset = progress[index]
            logprobs, offset = completion_logprobs(meta, sent, offset, req.logprobs > 0, lp=logprobs)
            progress[index] = (max(sent, len(meta.get("output_token_logprobs", []))), offset)
        delta = echoed + delta
        reason, matched = finish_reason(meta)
        if not (delta or reason or (logprobs and logprobs.tokens) or ids.get("token_ids") or "prompt_token_ids" in ids):
            return None
        return CompletionChoice(
            index=index, text=delta, logprobs=logprobs, finish_reason=reason, matched_stop=matched, **ids
        )

    def hidden_states_choice(self, index: int, states: list) -> CompletionChoice:
        return CompletionChoice(index=index, text="", hidden_states=states)
