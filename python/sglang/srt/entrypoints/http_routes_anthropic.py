"""Anthropic's Messages API routes, as upstream serves them: /v1/messages and /v1/messages/count_tokens
(`entrypoints/anthropic/serving.py`). With --api-key they take the key as Anthropic's clients send it
(`x-api-key`) or as a bearer token."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from sglang.srt.entrypoints.http_context import Server
from sglang.srt.entrypoints.http_errors import ErrorMappingRoute

router = APIRouter(route_class=ErrorMappingRoute)


@router.post("/v1/messages")
async def v1_messages(request: Request, s: Server) -> Response:
    return await s.anthropic.messages(request)


@router.post("/v1/messages/count_tokens")
async def v1_messages_count_tokens(request: Request, s: Server) -> Response:
    return await s.anthropic.count_tokens(request)
