"""The HTTP server: FastAPI routes over the TokenizerManager (SGLang's native API and OpenAI's).

Process layout as SGLang: this process runs uvicorn and the TokenizerManager on one event loop; the
scheduler and the detokenizer are subprocesses (`process_launcher`). Every route answers bad input with
HTTP 400 (OpenAI's error body), and no request can stop the server: failures are caught per request.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import fields
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from sglang.srt.entrypoints.engine import build_server_info
from sglang.srt.entrypoints.openai.protocol import ModelCard, ModelList
from sglang.srt.entrypoints.openai.serving_base import (
    CLIENT_CLOSED,
    SSEResponse,
    error_body,
    error_response,
    internal_error_response,
    json_response,
    sse,
    sse_stream,
    start_generation,
)
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import ClientDisconnected, TokenizerManager
from sglang.srt.metrics.collector import MetricsCollector

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
_GENERATE_FIELDS = {f.name for f in fields(GenerateReqInput)}


def parse_generate_body(body: bytes) -> GenerateReqInput:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"The request body is not valid JSON: {e}.", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError("The request body must be a JSON object.", None, "invalid_type")
    # Fields of SGLang features this runtime lacks are accepted when unset (clients send nulls).
    unknown = sorted(
        k
        for k, v in data.items()
        if k not in _GENERATE_FIELDS and not (v is None or v is False or v in ([], {}))
    )
    if unknown:
        raise RequestError(
            f"{unknown[0]} is not a supported field of /generate.", unknown[0], "unknown_parameter"
        )
    # null means "the default" for known fields too.
    return GenerateReqInput(**{k: v for k, v in data.items() if k in _GENERATE_FIELDS and v is not None})


def log_startup(server_args: Any, model_info: dict[str, Any], state: dict[str, Any]) -> None:
    mamba = state.get("mamba_usage", {})
    logger.info(
        "Serving %s: --mamba-scheduler-strategy %s (%s); token pool %d tokens, mamba pool %s slots, "
        "%s resident mamba slots per running request, max running requests %d, context length %d.",
        server_args.model_path,
        state.get("mamba_scheduler_strategy", server_args.mamba_scheduler_strategy),
        state.get("mamba_strategy_reason") or server_args.mamba_strategy_reason or "as requested",
        model_info["max_total_num_tokens"],
        mamba.get("total", "?"),
        state.get("resident_slots_per_req", "?"),
        model_info["max_running_requests"],
        model_info["context_len"],
    )


def create_app(server_args: Any, tm: TokenizerManager, model_info: dict[str, Any]) -> FastAPI:
    model_name = server_args.served_model_name
    metrics = MetricsCollector(model_name) if server_args.enable_metrics else None
    tm.observer = metrics
    chat = OpenAIServingChat(tm, model_name)
    completions = OpenAIServingCompletion(tm, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await tm.start()
        log_startup(server_args, model_info, await tm.get_internal_state())
        logger.info("The server is fired up and ready to roll!")
        yield
        await tm.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    if server_args.api_key:
        expected = f"Bearer {server_args.api_key}"

        @app.middleware("http")
        async def check_api_key(request: Request, call_next: Any) -> Response:
            if request.url.path != "/health" and request.headers.get("authorization") != expected:
                body = error_body(
                    "Invalid or missing API key (Authorization: Bearer ...).", code="invalid_api_key"
                )
                return json_response(body, 401)
            return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if tm.backend_alive() else 503)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        obj = GenerateReqInput(input_ids=[1], sampling_params={"max_new_tokens": 1, "temperature": 0})

        async def run() -> None:
            async for _ in tm.generate_request(obj):
                pass

        try:
            await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
        except Exception as e:
            logger.warning("health_generate failed: %r", e)
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/get_model_info")
    @app.get("/model_info")
    async def get_model_info() -> Response:
        arch = server_args.model_config.arch
        return json_response(
            {
                "model_path": server_args.model_path,
                "tokenizer_path": server_args.tokenizer_path,
                "served_model_name": model_name,
                "is_generation": True,
                "architecture": arch.architecture,
                "vocab_size": model_info["vocab_size"],
                "context_length": model_info["context_len"],
                "max_req_input_len": model_info["max_req_input_len"],
            }
        )

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> Response:
        try:
            state = await tm.get_internal_state()
        except TimeoutError as e:
            return json_response(error_body(str(e), kind="server_error", code="timeout"), 503)
        return json_response(build_server_info(server_args, model_info, state))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        try:
            out = await tm.flush_cache()
        except TimeoutError as e:
            return json_response(error_body(str(e), kind="server_error", code="timeout"), 503)
        if out.success:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(f"Cache not flushed: {out.message or 'requests are running.'}\n", 400)

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        try:
            data = orjson.loads(await request.body() or b"{}")
        except orjson.JSONDecodeError as e:
            return error_response(
                RequestError(f"The request body is not valid JSON: {e}.", None, "invalid_json")
            )
        rid, abort_all = (
            (data.get("rid"), data.get("abort_all", False)) if isinstance(data, dict) else (None, None)
        )
        if not isinstance(abort_all, bool) or (not abort_all and (not isinstance(rid, str) or not rid)):
            return error_response(RequestError('Send {"rid": "<request id>"} or {"abort_all": true}.', "rid"))
        tm.abort_request(rid or "", abort_all)
        return Response(status_code=200)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            obj = parse_generate_body(await request.body())
            first, gen = await start_generation(tm, obj, request)
        except RequestError as e:
            return error_response(e)
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED)
        except Exception as e:
            return internal_error_response(e)
        if obj.stream:
            return SSEResponse(sse_stream(_native_events(first, gen)))
        await gen.aclose()
        return json_response(first)

    @app.get("/v1/models")
    async def models() -> Response:
        card = ModelCard(id=model_name, root=server_args.model_path, max_model_len=model_info["context_len"])
        return json_response(ModelList(data=[card]))

    @app.post("/v1/completions")
    async def v1_completions(request: Request) -> Response:
        return await completions.handle(request)

    @app.post("/v1/chat/completions")
    async def v1_chat_completions(request: Request) -> Response:
        return await chat.handle(request)

    if metrics is not None:

        @app.get("/metrics")
        async def get_metrics() -> Response:
            try:
                state = await tm.get_internal_state(timeout=5.0)
            except TimeoutError:
                state = None  # serve the request-side metrics even when the scheduler is busy
            return Response(metrics.render(state), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


async def _native_events(first: Any, gen: Any):
    yield sse(first)
    async for chunk in gen:
        yield sse(chunk)
