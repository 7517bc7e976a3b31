"""The control routes (admin ones, `utils/auth.py`): flush the cache, pause and continue generation,
abort requests, start and stop the profiler and the expert distribution recorder, freeze the collector,
configure the request log."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from sglang.srt.entrypoints.http_context import Server
from sglang.srt.entrypoints.http_errors import ErrorMappingRoute, json_object, json_response
from sglang.srt.managers.profile_request import parse_profile_request
from sglang.srt.managers.request_log import configure_logging as apply_logging
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.utils.auth import AuthLevel, auth_level

PAUSE_MODES = ("abort", "retract", "in_place")

router = APIRouter(route_class=ErrorMappingRoute)
admin = auth_level(AuthLevel.ADMIN_OPTIONAL)


@router.api_route("/flush_cache", methods=["GET", "POST"])
@admin
async def flush_cache(s: Server) -> Response:
    out = await s.tm.flush_cache()
    if out.success:
        return PlainTextResponse("Cache flushed.\n")
    return PlainTextResponse(f"{out.message or 'The cache was not flushed: requests are running.'}\n", 400)


@router.post("/pause_generation")
@admin
async def pause_generation(request: Request, s: Server) -> Response:
    data = json_object(await request.body())
    mode = data.get("mode", "abort") if isinstance(data, dict) else None
    if mode not in PAUSE_MODES:
        raise RequestError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}.", "mode")
    await s.tm.pause_generation(mode)
    return json_response({"message": "Generation paused successfully.", "status": "ok"})


@router.post("/continue_generation")
@admin
async def continue_generation(s: Server) -> Response:
    await s.tm.continue_generation()
    return json_response({"message": "Generation continued successfully.", "status": "ok"})


@router.post("/abort_request")
@admin
async def abort_request(request: Request, s: Server) -> Response:
    data = json_object(await request.body())
    rid, abort_all = (
        (data.get("rid"), data.get("abort_all", False)) if isinstance(data, dict) else (None, None)
    )
    if not isinstance(abort_all, bool) or (not abort_all and (not isinstance(rid, str) or not rid)):
        raise RequestError('Send {"rid": "<request id>"} or {"abort_all": true}.', "rid")
    s.tm.abort_request(rid or "", abort_all)
    return Response(status_code=200)


@router.api_route("/start_profile", methods=["GET", "POST"])
@admin
async def start_profile(request: Request, s: Server) -> Response:
    """Upstream's: start the schedulers' torch profiler (the body's fields: `profile_request.py`)."""
    args = s.server_args
    req = parse_profile_request(
        json_object(await request.body()), args.device == "cuda", args.tp_size * args.dp_size
    )
    out = await s.tm.start_profile(req)
    if not out.success:
        return PlainTextResponse(f"{out.message}\n", 400)
    return PlainTextResponse("Start profiling.\n")


@router.api_route("/stop_profile", methods=["GET", "POST"])
@admin
async def stop_profile(s: Server) -> Response:
    """Stop it; the reply comes once the traces are written (upstream replies before)."""
    out = await s.tm.stop_profile()
    if not out.success:
        return PlainTextResponse(f"{out.message}\n", 400)
    return PlainTextResponse(f"Stop profiling. {out.message}\n")


@router.api_route("/freeze_gc", methods=["GET", "POST"])
@admin
async def freeze_gc(s: Server) -> Response:
    """Upstream's (after a warm-up): `TokenizerManager.freeze_gc`."""
    await s.tm.freeze_gc()
    return PlainTextResponse("Garbage collection frozen.\n")


@router.api_route("/configure_logging", methods=["GET", "POST"])
@admin
async def configure_logging(request: Request, s: Server) -> Response:
    """Upstream's: the request log's switch, level and format, and the HTTP process's log level."""
    s.tm.observer = apply_logging(json_object(await request.body()), s.server_args, s.tm.observer)
    return Response(status_code=200)


EXPERT_DISTRIBUTION_REPLIES = {
    "start": "Start recording the expert distribution.\n",
    "stop": "Stop recording the expert distribution.\n",
    "dump": "Dump expert distribution record.\n",
}


async def _expert_distribution(s: Server, action: str) -> Response:
    out = await s.tm.expert_distribution(action)
    if not out.success:
        return PlainTextResponse(f"{out.message}\n", 400)
    return PlainTextResponse(EXPERT_DISTRIBUTION_REPLIES[action])


@router.api_route("/start_expert_distribution_record", methods=["GET", "POST"])
@admin
async def start_expert_distribution_record(s: Server) -> Response:
    """Upstream's (--expert-distribution-recorder-mode): clear the record and record."""
    return await _expert_distribution(s, "start")


@router.api_route("/stop_expert_distribution_record", methods=["GET", "POST"])
@admin
async def stop_expert_distribution_record(s: Server) -> Response:
    return await _expert_distribution(s, "stop")


@router.api_route("/dump_expert_distribution_record", methods=["GET", "POST"])
@admin
async def dump_expert_distribution_record(s: Server) -> Response:
    """Write the record to SGLANG_EXPERT_DISTRIBUTION_RECORDER_DIR and clear it."""
    return await _expert_distribution(s, "dump")
