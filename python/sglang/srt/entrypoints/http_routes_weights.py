"""The weight routes (admin ones but /get_weight_version, `utils/auth.py`): updates from disk, tensors and
a distributed group, LoRA adapters' loads and unloads, memory release and resume, reading a parameter,
the weight version. Replies are
upstream's; errors are raised and answered by `http_errors`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from sglang.srt.configs.presets import is_preset
from sglang.srt.entrypoints.http_context import Server
from sglang.srt.entrypoints.http_errors import ErrorMappingRoute, json_object, json_response
from sglang.srt.lora.lora_registry import parse_load_lora_adapter, parse_unload_lora_adapter
from sglang.srt.managers.io_struct import ReleaseMemoryOccupationReqInput, ResumeMemoryOccupationReqInput
from sglang.srt.managers.request_validation import RequestError
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
from sglang.srt.utils.auth import AuthLevel, auth_level

router = APIRouter(route_class=ErrorMappingRoute)
admin = auth_level(AuthLevel.ADMIN_OPTIONAL)


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


def _weights_route(
    path: str,
    parse: Callable[[Any], Any],
    call: str,
    methods: tuple[str, ...] = ("POST",),
    fields: tuple[str, ...] = ("success", "message"),
) -> None:
    """A weight route whose reply is upstream's: the TokenizerManager's `call` result as `fields`
    ({"success", "message"} and maybe more), 200 on success, else 400 and why."""

    async def handle(request: Request, s: Server) -> Response:
        obj = parse(json_object(await request.body()))
        body = dict(zip(fields, await getattr(s.tm, call)(obj, request), strict=True))
        return json_response(body, 200 if body["success"] else 400)

    handle.__name__ = call
    router.api_route(path, methods=list(methods))(admin(handle))


_weights_route(
    "/update_weights_from_disk",
    _parse_disk_update_of_a_folder,
    "update_weights_from_disk",
    fields=("success", "message", "num_paused_requests"),
)
_weights_route("/update_weights_from_tensor", parse_update_weights_from_tensor, "update_weights_from_tensor")
_weights_route("/init_weights_update_group", parse_init_weights_update_group, "init_weights_update_group")
_weights_route(
    "/update_weights_from_distributed",
    parse_update_weights_from_distributed,
    "update_weights_from_distributed",
)
_weights_route(
    "/destroy_weights_update_group", parse_destroy_weights_update_group, "destroy_weights_update_group"
)
# LoRA adapters (upstream's routes and replies; docs/lora.md).
for _path, _parse, _call in [
    ("/load_lora_adapter", parse_load_lora_adapter, "load_lora_adapter"),
    ("/unload_lora_adapter", parse_unload_lora_adapter, "unload_lora_adapter"),
]:
    _weights_route(_path, _parse, _call, fields=("success", "error_message", "loaded_adapters"))
# As upstream: GET or POST, the body optional (no tags: all of them).
for _path, _cls, _call in [
    ("/release_memory_occupation", ReleaseMemoryOccupationReqInput, "release_memory_occupation"),
    ("/resume_memory_occupation", ResumeMemoryOccupationReqInput, "resume_memory_occupation"),
]:
    _weights_route(_path, lambda body, cls=_cls: parse_memory_occupation(body, cls), _call, ("GET", "POST"))


@router.api_route("/get_weights_by_name", methods=["GET", "POST"])
@admin
async def get_weights_by_name(request: Request, s: Server) -> Response:
    # As upstream: the parameter's first rows as a bare JSON list.
    obj = parse_get_weights_by_name(json_object(await request.body()))
    return json_response(await s.tm.get_weights_by_name(obj, request))


@router.post("/update_weight_version")
@admin
async def update_weight_version(request: Request, s: Server) -> Response:
    version, abort = parse_update_weight_version(json_object(await request.body()))
    s.tm.update_weight_version(version, abort)
    message = f"Weight version updated to {version}."
    return json_response({"success": True, "message": message, "new_version": version})


@router.get("/get_weight_version")
async def get_weight_version(s: Server) -> Response:
    return json_response({"weight_version": s.server_args.weight_version})
