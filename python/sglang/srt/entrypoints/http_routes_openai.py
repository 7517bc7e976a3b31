"""The OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses (and its
stored responses' routes), and upstream's /tokenize and /detokenize (also as /v1/tokenize and
/v1/detokenize, as upstream serves them)."""

from __future__ import annotations

import orjson
from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException

from sglang.srt.entrypoints.http_context import Server
from sglang.srt.entrypoints.http_errors import ErrorMappingRoute, json_response
from sglang.srt.entrypoints.openai.protocol import ModelCard, ModelList

router = APIRouter(route_class=ErrorMappingRoute)


@router.get("/v1/models")
async def models(s: Server) -> Response:
    context_len = s.model_info["context_len"]
    cards = [ModelCard(id=s.model_name, root=s.server_args.model_path, max_model_len=context_len)]
    # As upstream: each LoRA adapter too (a request names it as "base:adapter" or by its name).
    for name, path in s.tm.lora.loaded().items():
        cards.append(ModelCard(id=name, root=path, parent=s.model_name, max_model_len=context_len))
    return json_response(ModelList(data=cards))


@router.get("/v1/models/{model:path}")
async def model_card(model: str, s: Server) -> Response:
    """One model's card (upstream's route; the openai client's `models.retrieve`): the served model's,
    or a loaded LoRA adapter's (by its name or as "base:adapter"); 404 for any other name."""
    _, adapter = s.tm.lora.split_model(model)  # ("base:adapter", as the other routes take it)
    cards = (await models(s)).body
    for card in orjson.loads(cards)["data"]:
        if card["id"] in (model, adapter):
            return json_response(card)
    raise HTTPException(404, f"The model {model!r} does not exist")


@router.post("/v1/completions")
async def v1_completions(request: Request, s: Server) -> Response:
    return await s.completions.handle(request)


@router.post("/v1/chat/completions")
async def v1_chat_completions(request: Request, s: Server) -> Response:
    return await s.chat.handle(request)


@router.post("/v1/score")
async def v1_score(request: Request, s: Server) -> Response:
    return await s.score.handle(request)


@router.post("/v1/responses")
async def v1_responses(request: Request, s: Server) -> Response:
    return await s.responses.create(request)


@router.get("/v1/responses/{response_id}")
async def v1_response(response_id: str, s: Server) -> Response:
    return s.responses.retrieve(response_id)


@router.delete("/v1/responses/{response_id}")
async def v1_response_delete(response_id: str, s: Server) -> Response:
    return await s.responses.delete(response_id)


@router.post("/v1/responses/{response_id}/cancel")
async def v1_response_cancel(response_id: str, s: Server) -> Response:
    return await s.responses.cancel(response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def v1_response_input_items(
    response_id: str, s: Server, order: str = "desc", limit: str = "20", after: str | None = None
) -> Response:
    return s.responses.input_items(response_id, order, limit, after)


@router.post("/v1/tokenize")
@router.post("/tokenize")
async def tokenize(request: Request, s: Server) -> Response:
    return json_response(await s.tokenize.tokenize(await request.body(), request.url.path))


@router.post("/v1/detokenize")
@router.post("/detokenize")
async def detokenize(request: Request, s: Server) -> Response:
    return json_response(await s.tokenize.detokenize(await request.body(), request.url.path))
