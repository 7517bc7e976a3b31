"""Upstream's scoring API: `POST /v1/score` and `Engine.score`: for each item, the probability of each of
`label_token_ids` as the next token after `query + item` (`item + query` with `item_first`), e.g. a yes/no
judgement or a class per item, in one batch (the query is a shared prefix: the prefix cache holds it).

`query` and `items` are text (a string, a list of strings) or token ids (a list, a list of lists), the two
alike. `apply_softmax` false: each label's probability over the whole vocabulary; true: renormalized over
the labels. The reply: `{"object": "scoring", "model", "scores": [[p per label] per item]}`.
"""

from __future__ import annotations

import math
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from sglang.srt.entrypoints.http_errors import json_response
from sglang.srt.entrypoints.openai.serving_base import parse_json_model, reword, start_generation
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import RequestError


class ScoringRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    query: str | list[StrictInt]
    items: str | list[str] | list[list[StrictInt]]
    label_token_ids: list[StrictInt] = Field(min_length=1)
    apply_softmax: bool = False
    item_first: bool = False


async def scoring_input(tm: Any, req: ScoringRequest, lora_path: str | None = None) -> GenerateReqInput:
    """One prompt per item, generating one token to read the labels' logprobs at the next position. Text
    is tokenized here (query and item joined first, as upstream), so that every prompt's length is
    checked whole: a prompt is never cut (--allow-auto-truncate would score another position)."""
    items = [req.items] if isinstance(req.items, str) else req.items
    if not items:
        raise RequestError("items: at least one item is needed.", "items")
    text = isinstance(req.query, str)
    if any(isinstance(item, str) != text for item in items):
        raise RequestError("items: the items are text where the query is, token ids where it is.", "items")
    if text and tm.tokenizer is None:
        raise RequestError("query: text needs a tokenizer (--skip-tokenizer-init): send token ids.", "query")
    joined = [item + req.query if req.item_first else req.query + item for item in items]
    prompts = []
    for k, prompt in enumerate(joined):
        ids = await tm.encode(prompt, f"items[{k}]") if text else prompt
        if not ids:
            raise RequestError(f"items[{k}]: the query and the item are both empty.", f"items[{k}]")
        if len(ids) > tm.limits.max_req_input_len:
            raise RequestError(
                f"items[{k}]: the query and the item are {len(ids)} tokens; a scored prompt is at most "
                f"{tm.limits.max_req_input_len} (the scored position needs the next one).",
                f"items[{k}]",
            )
        prompts.append(ids)
    return GenerateReqInput(
        input_ids=prompts,
        sampling_params=[{"max_new_tokens": 1, "temperature": 0} for _ in prompts],
        return_logprob=True,
        logprob_start_len=-1,
        token_ids_logprob=list(req.label_token_ids),
        lora_path=lora_path,
    )


# The native fields' words in this API's (the request checks below name the native ones).
NATIVE_WORDS = {"token_ids_logprob": "label_token_ids", "input_ids": "items", "lora_path": "model"}


def renamed(err: RequestError) -> RequestError:
    param = (err.param or "").partition("[")[0]
    return RequestError(reword(err.message, NATIVE_WORDS, indexed=True), NATIVE_WORDS.get(param, err.param), err.code)


def scores_of(outputs: list[dict], label_token_ids: list[int], apply_softmax: bool) -> list[list[float]]:
    scores = []
    for out in outputs:
        entries = out["meta_info"]["output_token_ids_logprobs"][0]
        by_id = {entry[1]: entry[0] for entry in entries}
        logprobs = [by_id[t] for t in label_token_ids]
        if apply_softmax and max(logprobs) == -math.inf:  # (no label possible: no share to give)
            scores.append([0.0] * len(logprobs))
        elif apply_softmax:
            top = max(logprobs)
            weights = [math.exp(lp - top) for lp in logprobs]
            scores.append([w / sum(weights) for w in weights])
        else:
            scores.append([math.exp(lp) for lp in logprobs])
    return scores


class OpenAIServingScore:
    def __init__(self, tokenizer_manager: Any, model_name: str):
        self.tm = tokenizer_manager
        self.model_name = model_name

    async def handle(self, request: Request) -> Response:
        req = parse_json_model(ScoringRequest, await request.body())
        _, adapter = self.tm.lora.split_model(req.model)
        if adapter == "":
            raise RequestError(f"model {req.model!r} names no adapter after ':'.", "model")
        try:
            obj = await scoring_input(self.tm, req, adapter)
            first, gen = await start_generation(self.tm, obj, request)
        except RequestError as e:
            raise renamed(e) from None
        await gen.aclose()
        outputs = first if isinstance(first, list) else [first]
        return json_response({
            "object": "scoring", "model": req.model or self.model_name,
            "scores": scores_of(outputs, req.label_token_ids, req.apply_softmax), "usage": None,
        })  # fmt: skip
