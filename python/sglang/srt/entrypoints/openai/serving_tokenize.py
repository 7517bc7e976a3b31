"""/tokenize and /detokenize (and their /v1/ names), upstream's request and reply shapes:
    {"model"?, "prompt": str | [str], "add_special_tokens"?: true} -> {"tokens", "count", "max_model_len"}
    {"model"?, "tokens": [int] | [[int]], "skip_special_tokens"?: true} -> {"text": str | [str]}
A list gives lists. The input is bounded by the request body limit, as every route's; long texts are
tokenized off the event loop (`TextEncoder`) and many ids decoded on a thread (the tokenizer's batch
decode lets go of the GIL there), so a large request does not hold other clients' requests.
"""

from __future__ import annotations

import asyncio

from pydantic import BaseModel

from sglang.srt.entrypoints.openai.serving_base import parse_model
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import TokenizerManager

# Ids decoded on the loop up to this many (a few ms); more go to a thread.
INLINE_DECODE_IDS = 4096


class TokenizeRequest(BaseModel):  # (unknown fields are ignored, as upstream)
    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    tokens: list[int] | list[list[int]]
    count: int | list[int]
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int] | list[list[int]]
    skip_special_tokens: bool = True


class DetokenizeResponse(BaseModel):
    text: str | list[str]


class OpenAIServingTokenize:
    def __init__(self, tokenizer_manager: TokenizerManager, context_len: int, vocab_size: int):
        self.tm = tokenizer_manager
        self.context_len = context_len
        self.vocab_size = vocab_size

    async def tokenize(self, body: bytes, route: str) -> TokenizeResponse:
        self._need_tokenizer(route, "prompt")
        req = parse_model(TokenizeRequest, body)
        texts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        assert self.tm.encoder is not None
        # A limit no text reaches: a byte-level token covers at least one of a character's (at most 4)
        # UTF-8 bytes, plus the special tokens added. The body limit is what bounds the work.
        limit = 4 * max((len(t) for t in texts), default=0) + 64
        encoded = await self.tm.encoder.encode_many(texts, limit, req.add_special_tokens)
        for i, enc in enumerate(encoded):
            if enc.ids is None:
                param = "prompt" if isinstance(req.prompt, str) else f"prompt[{i}]"
                raise RequestError(f"{param} has more than {limit} tokens.", param)
        ids = [enc.ids for enc in encoded]
        if isinstance(req.prompt, str):
            return TokenizeResponse(tokens=ids[0], count=len(ids[0]), max_model_len=self.context_len)
        return TokenizeResponse(tokens=ids, count=[len(x) for x in ids], max_model_len=self.context_len)

    async def detokenize(self, body: bytes, route: str) -> DetokenizeResponse:
        self._need_tokenizer(route, "tokens")
        req = parse_model(DetokenizeRequest, body)
        single = not req.tokens or isinstance(req.tokens[0], int)
        lists: list[list[int]] = [req.tokens] if single else req.tokens  # type: ignore[list-item]
        for i, ids in enumerate(lists):
            bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                param = "tokens" if single else f"tokens[{i}]"
                raise RequestError(
                    f"{param}: token id {bad} is outside the vocabulary (0 to {self.vocab_size - 1}).", param
                )
        texts = await self._decode(lists, req.skip_special_tokens)
        return DetokenizeResponse(text=texts[0] if single else texts)

    async def _decode(self, lists: list[list[int]], skip_special_tokens: bool) -> list[str]:
        tok = self.tm.tokenizer
        if sum(len(ids) for ids in lists) <= INLINE_DECODE_IDS:
            return [tok.decode(ids, skip_special_tokens=skip_special_tokens) for ids in lists]
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is None:  # a slow tokenizer holds the GIL anyway; a thread still keeps the loop turning
            return await asyncio.to_thread(tok.batch_decode, lists, skip_special_tokens=skip_special_tokens)
        texts = await asyncio.to_thread(backend.decode_batch, lists, skip_special_tokens=skip_special_tokens)
        if getattr(tok, "clean_up_tokenization_spaces", False):  # as the tokenizer's own decode does
            texts = [tok.clean_up_tokenization(t) for t in texts]
        return texts

    def _need_tokenizer(self, route: str, param: str) -> None:
        if self.tm.tokenizer is None:
            raise RequestError(
                f"{route} needs a tokenizer, and this server was started with --skip-tokenizer-init "
                "(it serves token ids only: tokenize and detokenize on the client).",
                param,
            )
