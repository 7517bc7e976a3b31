"""The HTTP server: FastAPI routes over the TokenizerManager (SGLang's native API and OpenAI's).

Process layout as SGLang: this process runs uvicorn and the TokenizerManager on one event loop; the
scheduler and the detokenizer are subprocesses (`process_launcher`). The routes are `APIRouter`s by
kind: native (`http_routes_native`), OpenAI (`http_routes_openai`), weights (`http_routes_weights`) and
control (`http_routes_control`); they share a `ServerContext` (`http_context`). Routes raise, and the
exception handlers of `http_errors` answer: bad input is HTTP 400 naming the field, and no request can
stop the server (failures are caught per request). Bodies are read, size-checked and timed by
`http_guard.RequestGuard` before a route sees them, after it has checked the API key the route's level
asks for (`utils.auth.ApiKeyCheck`).
"""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from sglang.srt.entrypoints import (
    http_routes_anthropic,
    http_routes_control,
    http_routes_native,
    http_routes_openai,
    http_routes_weights,
)
from sglang.srt.entrypoints.anthropic.serving import AnthropicServing
from sglang.srt.entrypoints.http_context import ServerContext
from sglang.srt.entrypoints.http_errors import install_error_handlers
from sglang.srt.entrypoints.http_guard import RequestGuard
from sglang.srt.entrypoints.openai.response_store import ResponseStore
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.entrypoints.openai.serving_responses import OpenAIServingResponses
from sglang.srt.entrypoints.openai.serving_score import OpenAIServingScore
from sglang.srt.entrypoints.openai.serving_tokenize import OpenAIServingTokenize
from sglang.srt.entrypoints.server_warmup import needs_shape_warmup, run_server_warmup, warmup_prompt_lengths
from sglang.srt.environ import envs
from sglang.srt.managers.request_log import observers
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.metrics.collector import MetricsCollector
from sglang.srt.metrics.scheduler_collector import STARTUP_PHASES
from sglang.srt.metrics.token_buckets import token_buckets
from sglang.srt.sampling.model_defaults import model_sampling_defaults
from sglang.srt.utils.auth import ApiKeyCheck

logger = logging.getLogger(__name__)


# The scheduler's `startup_times` (model_runner.py, scheduler_io.py) as the start log names them; the
# warm-up logs its own time after these.
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
    times = state.get("startup_times") or {}
    if times:
        parts = [f"{words} {times[key]:.2f} s" for key, words, _ in STARTUP_PHASES if key in times]
        logger.info("Scheduler start: %s.", ", ".join(parts))
    for i, mem in enumerate(state.get("memory_bytes_by_rank") or []):
        if len(state["memory_bytes_by_rank"]) > 1 and mem:
            logger.info(
                "Rank %d memory: weights %.1f MB, KV pool %.1f MB, state pool %.1f MB.",
                i, mem["weights"] / 2**20, mem["kv_pool"] / 2**20, mem["state_pool"] / 2**20,
            )  # fmt: skip


def create_app(server_args: Any, tm: TokenizerManager, model_info: dict[str, Any]) -> RequestGuard:
    """The ASGI app: the routes, behind the request guard (body limit and read timeouts)."""
    model_name = server_args.served_model_name
    metrics = None
    if server_args.enable_metrics:
        metrics = MetricsCollector(
            model_name, server_args.bucket_time_to_first_token, server_args.bucket_inter_token_latency,
            server_args.bucket_e2e_request_latency,
            token_buckets(server_args.prompt_tokens_buckets, "--prompt-tokens-buckets"),
            token_buckets(server_args.generation_tokens_buckets, "--generation-tokens-buckets"),
        )  # fmt: skip
    tm.observer = observers(server_args, metrics)
    sampling_defaults = {}
    if server_args.sampling_defaults == "model":
        sampling_defaults = model_sampling_defaults(server_args.model_config.path)
        if sampling_defaults:
            logger.info(
                "Chat requests take the model's sampling defaults for unset fields: %s.", sampling_defaults
            )
    include_usage = server_args.stream_response_default_include_usage
    chat = OpenAIServingChat(
        tm, model_name, sampling_defaults, server_args.reasoning_parser, server_args.tool_call_parser,
        server_args.default_chat_template_kwargs, include_usage,
    )  # fmt: skip
    completions = OpenAIServingCompletion(tm, model_name, include_usage)
    store = None
    if server_args.enable_response_store:
        store = ResponseStore(server_args.response_store_max_mb * 2**20)
    responses = OpenAIServingResponses(chat, store, caches_prompts=not server_args.disable_radix_cache)
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
            shapes = None
            if needs_shape_warmup(server_args):
                shapes = warmup_prompt_lengths(
                    server_args.chunked_prefill_size, server_args.max_prefill_tokens,
                    model_info["max_req_input_len"], model_info["max_total_num_tokens"],
                )  # fmt: skip
            failure = await run_server_warmup(
                tm, model_info["context_len"], shapes, model_info["vocab_size"], server_args.dp_size
            )
            if failure is not None:
                logger.error("%s", failure)
                tm.health.declare(failure)  # the server answers 503 and shuts down (launch_server)
        yield
        await tm.close()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    tokenize = OpenAIServingTokenize(tm, model_info["context_len"], model_info["vocab_size"])
    app.state.server = ServerContext(
        server_args, tm, model_info, chat, completions, tokenize, metrics, responses, AnthropicServing(chat),
        OpenAIServingScore(tm, model_name),
    )
    install_error_handlers(app)
    routers = [
        m.router
        for m in (
            http_routes_native, http_routes_openai, http_routes_anthropic, http_routes_weights, http_routes_control
        )
    ]  # fmt: skip
    if metrics is not None:
        routers.append(http_routes_native.metrics_router)
    for router in routers:
        # The routes themselves, not FastAPI's wrapper of an included router: the API-key middleware
        # and the request guard look a path's route up in app.routes (its level, its template).
        app.router.routes.extend(router.routes)
    authorize = None
    if server_args.api_key or server_args.admin_api_key:
        authorize = ApiKeyCheck(app.router.routes, server_args.api_key, server_args.admin_api_key).refusal
    return RequestGuard(
        app,
        max_body_bytes=server_args.request_body_limit,
        read_timeout=envs.SGLANG_HTTP_READ_TIMEOUT.get(),
        observer=metrics,
        authorize=authorize,
    )
