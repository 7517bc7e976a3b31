"""The HTTP server: FastAPI routes over the TokenizerManager (SGLang's native API and OpenAI's).

Process layout as SGLang: this process runs uvicorn and the TokenizerManager on one event loop; the
scheduler and the detokenizer are subprocesses (`process_launcher`). Every route answers bad input with
HTTP 400 (OpenAI's error body), and no request can stop the server: failures are caught per request.
Bodies are read, size-checked and timed by `http_guard.RequestGuard` before a route sees them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from sglang.srt.configs.presets import is_preset
from sglang.srt.entrypoints.engine import build_server_info
from sglang.srt.entrypoints.generate_body import parse_generate_body
from sglang.srt.entrypoints.http_guard import RequestGuard
from sglang.srt.entrypoints.openai.protocol import ModelCard, ModelList
from sglang.srt.entrypoints.openai.serving_base import (
    CLIENT_CLOSED,
    SSEResponse,
    error_body,
    error_response,
    internal_error_response,
    json_response,
    server_abort_response,
    sse,
    sse_stream,
    start_generation,
)
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.entrypoints.server_warmup import run_server_warmup
from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import (
    GenerateReqInput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
)
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import (
    BackendDeadError,
    ClientDisconnected,
    ServerAbortError,
    TokenizerManager,
)
from sglang.srt.managers.weight_update_request import (
    parse_destroy_weights_update_group,
    parse_get_weights_by_name,
    parse_init_weights_update_group,
    parse_memory_occupation,
    parse_update_weight_version,
    parse_update_weights_from_disk,
    parse_update_weights_from_distributed,
    parse_update_weights_from_tensor,
)
from sglang.srt.metrics.collector import MetricsCollector
from sglang.srt.sampling.model_defaults import model_sampling_defaults
from sglang.srt.utils.auth import ApiKeyMiddleware, AuthLevel, auth_level

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT_S = 20.0
PAUSE_MODES = ("abort", "retract", "in_place")


def log_startup(server_args: Any, model_info: dict[str, Any], state: dict[str, Any]) -> None:
    mamba = state.get("mamba_usage", {})
    headroom = state.get("tree_headroom_slots_per_req", 0)
    if server_args.max_running_requests:
        cap = "as --max-running-requests"
    elif headroom:
        cap = f"derived, keeping {headroom} mamba slots per request for the radix cache"
    else:
        cap = "derived"
    logger.info(
        "Serving %s: --mamba-scheduler-strategy %s (%s); token pool %d tokens, mamba pool %s slots, "
        "%s resident mamba slots per running request, max running requests %d (%s), context length %d.",
        server_args.model_path,
        state.get("mamba_scheduler_strategy", server_args.mamba_scheduler_strategy),
        state.get("mamba_strategy_reason") or server_args.mamba_strategy_reason or "as requested",
        model_info["max_total_num_tokens"],
        mamba.get("total", "?"),
        state.get("resident_slots_per_req", "?"),
        model_info["max_running_requests"],
        cap,
        model_info["context_len"],
    )


def create_app(server_args: Any, tm: TokenizerManager, model_info: dict[str, Any]) -> RequestGuard:
    """The ASGI app: the routes, behind the request guard (body limit and read timeouts)."""
    model_name = server_args.served_model_name
    metrics = MetricsCollector(model_name) if server_args.enable_metrics else None
    tm.observer = metrics
    sampling_defaults = {}
    if server_args.sampling_defaults == "model":
        sampling_defaults = model_sampling_defaults(server_args.model_config.path)
        if sampling_defaults:
            logger.info(
                "Chat requests take the model's sampling defaults for unset fields: %s.", sampling_defaults
            )
    chat = OpenAIServingChat(
        tm, model_name, sampling_defaults, server_args.reasoning_parser, server_args.tool_call_parser
    )
    completions = OpenAIServingCompletion(tm, model_name)
    if server_args.enable_custom_logit_processor and not envs.SGLANG_LOGIT_PROCESSOR_SECRET.get():
        logger.warning(
            "--enable-custom-logit-processor without SGLANG_LOGIT_PROCESSOR_SECRET: every client that "
            "reaches %s:%d can run code in this server (a processor is unpickled code); set the secret "
            "to load only processors signed with it.",
            server_args.host,
            server_args.port,
        )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await tm.start()
        log_startup(server_args, model_info, await tm.get_internal_state())
        if not server_args.skip_server_warmup:  # before the port listens
            failure = await run_server_warmup(tm, model_info["context_len"])
            if failure is not None:
                logger.error("%s", failure)
                tm.health.declare(failure)  # the server answers 503 and shuts down (launch_server)
        yield
        await tm.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    if server_args.api_key or server_args.admin_api_key:
        app.add_middleware(
            ApiKeyMiddleware,
            routes=app.router.routes,
            api_key=server_args.api_key,
            admin_api_key=server_args.admin_api_key,
        )
    admin = auth_level(AuthLevel.ADMIN_OPTIONAL)

    @app.get("/health")
    async def health() -> Response:
        # Unhealthy once a child process has exited or the scheduler has stalled (the server then exits).
        return Response(status_code=503 if tm.health.error() else 200)

    @app.get("/health_generate")
    async def health_generate() -> Response:
        if tm.health.error():
            return Response(status_code=503)
        obj = GenerateReqInput(
            input_ids=[1], sampling_params={"max_new_tokens": 1, "temperature": 0}, log_metrics=False
        )

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
                "weight_version": server_args.weight_version,
            }
        )

    @app.get("/get_server_info")
    @app.get("/server_info")
    async def get_server_info() -> Response:
        try:
            state = await tm.get_internal_state()
        except (TimeoutError, BackendDeadError) as e:
            return _control_failed(e)
        return json_response(build_server_info(server_args, model_info, state))

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    @admin
    async def flush_cache() -> Response:
        try:
            out = await tm.flush_cache()
        except (TimeoutError, BackendDeadError) as e:
            return _control_failed(e)
        if out.success:
            return PlainTextResponse("Cache flushed.\n")
        return PlainTextResponse(
            f"{out.message or 'The cache was not flushed: requests are running.'}\n", 400
        )

    @app.post("/pause_generation")
    @admin
    async def pause_generation(request: Request) -> Response:
        try:
            data = _json_object(await request.body())
        except RequestError as e:
            return error_response(e)
        mode = data.get("mode", "abort") if isinstance(data, dict) else None
        if mode not in PAUSE_MODES:
            message = f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}."
            return error_response(RequestError(message, "mode"))
        try:
            await tm.pause_generation(mode)
        except (TimeoutError, BackendDeadError) as e:
            return _control_failed(e)
        return json_response({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    @admin
    async def continue_generation() -> Response:
        try:
            await tm.continue_generation()
        except (TimeoutError, BackendDeadError) as e:
            return _control_failed(e)
        return json_response({"message": "Generation continued successfully.", "status": "ok"})

    @app.post("/abort_request")
    @admin
    async def abort_request(request: Request) -> Response:
        try:
            data = _json_object(await request.body())
        except RequestError as e:
            return error_response(e)
        rid, abort_all = (
            (data.get("rid"), data.get("abort_all", False)) if isinstance(data, dict) else (None, None)
        )
        if not isinstance(abort_all, bool) or (not abort_all and (not isinstance(rid, str) or not rid)):
            return error_response(RequestError('Send {"rid": "<request id>"} or {"abort_all": true}.', "rid"))
        tm.abort_request(rid or "", abort_all)
        return Response(status_code=200)

    def weights_route(
        path: str,
        parse: Callable[[Any], Any],
        call: Callable[..., Any],
        methods: tuple[str, ...] = ("POST",),
        fields: tuple[str, ...] = ("success", "message"),
    ) -> None:
        """A weight route (an admin one) whose reply is upstream's: `call`'s result as `fields`
        ({"success", "message"} and maybe more), 200 on success, else 400 and why."""

        async def handle(request: Request) -> Response:
            try:
                obj = parse(_json_object(await request.body()))
                body = dict(zip(fields, await call(obj, request), strict=True))
            except RequestError as e:
                return error_response(e)
            except ClientDisconnected:
                return Response(status_code=CLIENT_CLOSED)
            except (TimeoutError, BackendDeadError) as e:
                return _control_failed(e)
            except Exception as e:
                return internal_error_response(e)
            return json_response(body, 200 if body["success"] else 400)

        app.api_route(path, methods=list(methods))(admin(handle))

    weights_route(
        "/update_weights_from_disk",
        _parse_disk_update_of_a_folder,
        tm.update_weights_from_disk,
        fields=("success", "message", "num_paused_requests"),
    )

    weights_route(
        "/update_weights_from_tensor", parse_update_weights_from_tensor, tm.update_weights_from_tensor
    )
    weights_route("/init_weights_update_group", parse_init_weights_update_group, tm.init_weights_update_group)
    weights_route(
        "/update_weights_from_distributed",
        parse_update_weights_from_distributed,
        tm.update_weights_from_distributed,
    )
    weights_route(
        "/destroy_weights_update_group", parse_destroy_weights_update_group, tm.destroy_weights_update_group
    )
    # As upstream: GET or POST, the body optional (no tags: all of them).
    for path, cls, call in [
        ("/release_memory_occupation", ReleaseMemoryOccupationReqInput, tm.release_memory_occupation),
        ("/resume_memory_occupation", ResumeMemoryOccupationReqInput, tm.resume_memory_occupation),
    ]:
        weights_route(path, lambda body, cls=cls: parse_memory_occupation(body, cls), call, ("GET", "POST"))

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    @admin
    async def get_weights_by_name(request: Request) -> Response:
        # As upstream: the parameter's first rows as a bare JSON list.
        try:
            obj = parse_get_weights_by_name(_json_object(await request.body()))
            return json_response(await tm.get_weights_by_name(obj, request))
        except RequestError as e:
            return error_response(e)
        except (TimeoutError, BackendDeadError) as e:
            return _control_failed(e)
        except Exception as e:
            return internal_error_response(e)

    @app.post("/update_weight_version")
    @admin
    async def update_weight_version(request: Request) -> Response:
        try:
            version, abort = parse_update_weight_version(_json_object(await request.body()))
        except RequestError as e:
            return error_response(e)
        tm.update_weight_version(version, abort)
        message = f"Weight version updated to {version}."
        return json_response({"success": True, "message": message, "new_version": version})

    @app.get("/get_weight_version")
    async def get_weight_version() -> Response:
        return json_response({"weight_version": server_args.weight_version})

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request) -> Response:
        try:
            obj = parse_generate_body(await request.body())
            first, gen = await start_generation(tm, obj, request)
        except RequestError as e:
            return error_response(e)
        except ServerAbortError as e:
            return server_abort_response(e)
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
            except (TimeoutError, BackendDeadError):
                state = None  # serve the request-side metrics even when the scheduler is busy or gone
            return Response(metrics.render(state), media_type="text/plain; version=0.0.4; charset=utf-8")

    return RequestGuard(
        app,
        max_body_bytes=server_args.request_body_limit,
        read_timeout=envs.SGLANG_HTTP_READ_TIMEOUT.get(),
        observer=metrics,
    )


def _parse_disk_update_of_a_folder(body: Any) -> Any:
    """Over HTTP a disk update loads a folder only: a preset name would make the scheduler generate that
    preset into the cache (minutes of CPU, files written) before refusing it."""
    obj = parse_update_weights_from_disk(body)
    if is_preset(obj.model_path):
        raise RequestError(
            f"model_path {obj.model_path!r} names a built-in preset, not a checkpoint folder: over HTTP "
            "/update_weights_from_disk loads folders only (give the folder's path).",
            "model_path",
        )
    return obj


def _control_failed(e: Exception) -> Response:
    """503 for a control call the scheduler did not answer (in time, or at all: it is gone)."""
    code = "backend_dead" if isinstance(e, BackendDeadError) else "timeout"
    return json_response(error_body(str(e), kind="server_error", code=code), 503)


def _json_object(body: bytes) -> Any:
    """An optional JSON body ({} when empty); RequestError when it is not JSON."""
    try:
        return orjson.loads(body or b"{}")
    except orjson.JSONDecodeError as e:
        raise RequestError(f"The request body is not valid JSON: {e}.", None, "invalid_json") from None


async def _native_events(first: Any, gen: Any):
    yield sse(first)
    async for chunk in gen:
        yield sse(chunk)
