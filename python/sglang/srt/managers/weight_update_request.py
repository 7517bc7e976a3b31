"""The bodies of upstream's weight-update routes, checked: /update_weights_from_disk and
/update_weight_version. A wrong field is a RequestError (HTTP 400) naming it; unknown keys are ignored,
as upstream ignores them."""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
from sglang.srt.managers.request_validation import RequestError

# Checkpoint formats this server reads (upstream's "auto" picks safetensors for these checkpoints).
LOAD_FORMATS = (None, "auto", "safetensors")


def parse_update_weights_from_disk(body: Any) -> UpdateWeightFromDiskReqInput:
    if not isinstance(body, dict):
        raise RequestError("The body must be a JSON object.", None, "invalid_type")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise RequestError("model_path must be the checkpoint folder to load.", "model_path", "invalid_type")
    values: dict[str, Any] = {"model_path": path}
    for f in dataclasses.fields(UpdateWeightFromDiskReqInput):
        if f.name == "model_path" or body.get(f.name) is None:
            continue
        value = body[f.name]
        kind = type(f.default) if f.default is not None else str
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise RequestError(f"{f.name} must be an integer.", f.name, "invalid_type")
        if kind is not int and not isinstance(value, kind):
            raise RequestError(f"{f.name} must be a {kind.__name__}.", f.name, "invalid_type")
        values[f.name] = value
    if values.get("load_format") not in LOAD_FORMATS:
        raise RequestError(
            f"load_format {values['load_format']!r} is not supported: this server loads safetensors "
            "checkpoints (auto or safetensors).",
            "load_format",
        )
    return UpdateWeightFromDiskReqInput(**values)


def parse_update_weight_version(body: Any) -> tuple[str, bool]:
    """(new_version, abort_all_requests: default true, as upstream's)."""
    if not isinstance(body, dict):
        raise RequestError("The body must be a JSON object.", None, "invalid_type")
    version = body.get("new_version")
    if not isinstance(version, str) or not version:
        raise RequestError("new_version must be a non-empty string.", "new_version", "invalid_type")
    abort = body.get("abort_all_requests", True)
    if not isinstance(abort, bool):
        raise RequestError("abort_all_requests must be a boolean.", "abort_all_requests", "invalid_type")
    return version, abort
