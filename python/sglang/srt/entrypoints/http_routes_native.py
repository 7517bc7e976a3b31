"""SGLang's native routes: health, model and server info, the loads (`server_loads`), /generate, the
sessions (/open_session, /close_session: `session_controller`), and /metrics (`metrics_router`, with --enable-metrics). Errors are raised and answered by `http_errors`."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from sglang.srt.entrypoints.generate_body import parse_generate_body
from sglang.srt.entrypoints.http_context import Server
from sglang.srt.entrypoints.http_errors import ErrorMappingRoute, json_object, json_response
from sglang.srt.entrypoints.openai.serving_base import SSEResponse, sse, sse_stream, start_generation
from sglang.srt.entrypoints.server_info import build_server_info
from sglang.srt.entrypoints.server_loads import legacy_loads, v1_loads, v1_loads_body, v1_loads_prometheus
from sglang.srt.managers.io_struct import GenerateReqInput, OpenSessionReqInput
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import BackendDeadError

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0

router = APIRouter(route_class=ErrorMappingRoute)
metrics_router = APIRouter(route_class=ErrorMappingRoute)


@router.get("/health")
async def health(s: Server) -> Response:
    # Unhealthy once a child process has exited or the scheduler has stalled (the server then exits).
    return Response(status_code=503 if s.tm.health.error() else 200)


@router.get("/health_generate")
async def health_generate(s: Server) -> Response:
    if s.tm.health.error():
        return Response(status_code=503)
    obj = GenerateReqInput(
        input_ids=[1], sampling_params={"max_new_tokens": 1, "temperature": 0}, log_metrics=False
    )

    async def run() -> None:
        async for _ in s.tm.generate_request(obj, warmup=True):  # (the server's own: not logged)
            pass

    try:
        await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
    except Exception as e:
        logger.warning("health_generate failed: %r", e)
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(s: Server) -> Response:
    args = s.server_args
    return json_response(
        {
            "model_path": args.model_path,
            "tokenizer_path": args.tokenizer_path,
            "served_model_name": s.model_name,
            "is_generation": True,
            "architecture": args.model_config.arch.architecture,
            "vocab_size": s.model_info["vocab_size"],
            "context_length": s.model_info["context_len"],
            "max_req_input_len": s.model_info["max_req_input_len"],
            "weight_version": args.weight_version,
            "preferred_sampling_params": args.preferred_sampling_params,
        }
    )


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(s: Server) -> Response:
    state = await s.tm.get_internal_state()
    return json_response(build_server_info(s.server_args, s.model_info, state, s.tm))


@router.get("/get_load")
async def get_load(s: Server) -> Response:
    """Upstream's (sglang-router's load-aware policies poll it): one load per data-parallel replica."""
    return json_response(legacy_loads(await s.tm.get_internal_state()))


@router.get("/v1/loads")
async def get_loads(request: Request, s: Server) -> Response:
    """Upstream's load report: `?dp_rank=N`, `?include=core,memory,queues,disagg|all`, `?format=prometheus`."""
    query = request.query_params
    dp_rank, fmt = query.get("dp_rank"), query.get("format", "json")
    if dp_rank is not None and not re.fullmatch(r"[0-9]{1,6}", dp_rank):
        raise RequestError(f"dp_rank must be a replica's number, got {dp_rank!r}.", "dp_rank")
    if fmt not in ("json", "prometheus"):
        raise RequestError(f"format must be json or prometheus, got {fmt!r}.", "format")
    state = await s.tm.get_internal_state()
    loads, aggregate = v1_loads(state, None if dp_rank is None else int(dp_rank), query.get("include"))
    if fmt == "prometheus":
        return PlainTextResponse(v1_loads_prometheus(loads), media_type="text/plain; version=0.0.4")
    return json_response(v1_loads_body(loads, aggregate))


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request, s: Server) -> Response:
    obj = parse_generate_body(await request.body())
    first, gen = await start_generation(s.tm, obj, request)
    if obj.stream:
        return SSEResponse(sse_stream(_native_events(first, gen)))
    await gen.aclose()
    return json_response(first)


@router.api_route("/open_session", methods=["GET", "POST"])
async def open_session(request: Request, s: Server) -> Response:
    """Upstream's: the new session's id, as a JSON string (a duplicate id or a bad field: 400)."""
    data = json_object(await request.body())
    if not isinstance(data, dict):
        raise RequestError("The request body must be a JSON object.", None, "invalid_type")
    fields = ("capacity_of_str_len", "session_id", "streaming", "timeout")
    obj = OpenSessionReqInput(**{k: data[k] for k in fields if data.get(k) is not None})
    return json_response(s.tm.sessions.open(obj))


@router.api_route("/close_session", methods=["GET", "POST"])
async def close_session(request: Request, s: Server) -> Response:
    """Upstream's: 200 whether or not the session was open."""
    data = json_object(await request.body())
    s.tm.sessions.close(data.get("session_id") if isinstance(data, dict) else None)
    return Response(status_code=200)


async def _native_events(first: Any, gen: AsyncIterator[Any]) -> AsyncIterator[bytes]:
    yield sse(first)
    async for chunk in gen:
        yield sse(chunk)


@metrics_router.get("/metrics")
async def get_metrics(s: Server) -> Response:
    assert s.metrics is not None  # (the router is included with --enable-metrics only)
    try:
        state = await s.tm.get_internal_state(timeout=5.0)
    except (TimeoutError, BackendDeadError):
        state = None  # serve the request-side metrics even when the scheduler is busy or gone
    return Response(s.metrics.render(state), media_type="text/plain; version=0.0.4; charset=utf-8")
