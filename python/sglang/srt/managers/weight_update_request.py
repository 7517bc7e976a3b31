"""The bodies of upstream's weight-update routes, checked: /update_weights_from_disk,
/update_weights_from_tensor and /update_weight_version. A wrong field is a RequestError (HTTP 400)
naming it; unknown keys are ignored, as upstream ignores them."""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput
from sglang.srt.managers.request_validation import RequestError

# Checkpoint formats this server reads (upstream's "auto" picks safetensors for these checkpoints).
LOAD_FORMATS = (None, "auto", "safetensors")
# /update_weights_from_tensor's: (name, tensor) pairs with checkpoint names, the same as one
# FlattenedTensorBucket ("flattened_bucket"), or pairs with this server's parameter names ("direct").
TENSOR_LOAD_FORMATS = (None, "flattened_bucket", "direct")


def parse_update_weights_from_disk(body: Any) -> UpdateWeightFromDiskReqInput:
    if not isinstance(body, dict):
        raise RequestError("The body must be a JSON object.", None, "invalid_type")
    path = body.get("model_path")
    if not isinstance(path, str) or not path:
        raise RequestError("model_path must be the checkpoint folder to load.", "model_path", "invalid_type")
    values = {"model_path": path, **_optional_fields(body, UpdateWeightFromDiskReqInput, {"model_path"})}
    if values.get("load_format") not in LOAD_FORMATS:
        raise RequestError(
            f"load_format {values['load_format']!r} is not supported: this server loads safetensors "
            "checkpoints (auto or safetensors).",
            "load_format",
        )
    return UpdateWeightFromDiskReqInput(**values)


def parse_update_weights_from_tensor(body: Any) -> UpdateWeightsFromTensorReqInput:
    """An HTTP body: the payloads are base64 text, and may not name file descriptors (`trusted`)."""
    if not isinstance(body, dict):
        raise RequestError("The body must be a JSON object.", None, "invalid_type")
    payloads = body.get("serialized_named_tensors")
    if not isinstance(payloads, list) or not payloads or not all(isinstance(p, str) and p for p in payloads):
        raise RequestError(
            "serialized_named_tensors must be a non-empty list of base64 strings "
            "(MultiprocessingSerializer.serialize(named_tensors, output_str=True), one per rank).",
            "serialized_named_tensors",
            "invalid_type",
        )
    skip = {"serialized_named_tensors", "trusted"}
    values = _optional_fields(body, UpdateWeightsFromTensorReqInput, skip)
    check_tensor_load_format(values.get("load_format"))
    return UpdateWeightsFromTensorReqInput(payloads, trusted=False, **values)


def check_tensor_load_format(load_format: Any) -> None:
    if load_format not in TENSOR_LOAD_FORMATS:
        raise RequestError(
            f"load_format {load_format!r} is not supported: send null or \"flattened_bucket\" (checkpoint "
            "names) or \"direct\" (this server's parameter names).",
            "load_format",
        )


def _optional_fields(body: dict, cls: type, skip: set[str]) -> dict[str, Any]:
    """The fields of `cls` other than `skip` that `body` sets (null: the default), each of its default's
    type (str where the default is None); RequestError naming the first that is not."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or body.get(f.name) is None:
            continue
        value = body[f.name]
        kind = type(f.default) if f.default is not None else str
        if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise RequestError(f"{f.name} must be an integer.", f.name, "invalid_type")
        if kind is not int and not isinstance(value, kind):
            raise RequestError(f"{f.name} must be a {kind.__name__}.", f.name, "invalid_type")
        values[f.name] = value
    return values


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
