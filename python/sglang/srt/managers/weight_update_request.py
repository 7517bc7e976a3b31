"""The bodies of upstream's weight-update routes, checked: /update_weights_from_disk,
/update_weights_from_tensor, /init_weights_update_group, /update_weights_from_distributed,
/destroy_weights_update_group, /update_weight_version, /get_weights_by_name,
/release_memory_occupation and /resume_memory_occupation. A wrong field is a RequestError (HTTP 400) naming it; unknown keys are
ignored, as upstream ignores them."""

from __future__ import annotations

import dataclasses
from typing import Any

from sglang.srt.managers.io_struct import (
    DestroyWeightsUpdateGroupReqInput,
    GetWeightsByNameReqInput,
    InitWeightsUpdateGroupReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromDistributedReqInput,
    UpdateWeightsFromTensorReqInput,
)
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.model_executor.memory_occupation import TAGS as MEMORY_TAGS

# Checkpoint formats this server reads (upstream's "auto" picks safetensors for these checkpoints).
LOAD_FORMATS = (None, "auto", "safetensors")
# /update_weights_from_tensor's: (name, tensor) pairs with checkpoint names, the same as one
# FlattenedTensorBucket ("flattened_bucket"), or pairs with this server's parameter names ("direct").
TENSOR_LOAD_FORMATS = (None, "flattened_bucket", "direct")


def parse_update_weights_from_disk(body: Any) -> UpdateWeightFromDiskReqInput:
    _check_object(body)
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
    _check_object(body)
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


# Process-group backends a weight-update group may use (gloo on a CPU, nccl between GPUs).
GROUP_BACKENDS = ("nccl", "gloo")
# The dtypes a broadcast weight may have, by torch's names ("torch.bfloat16" as well).
WEIGHT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def parse_init_weights_update_group(body: Any) -> InitWeightsUpdateGroupReqInput:
    _check_object(body)
    address = body.get("master_address")
    if not isinstance(address, str) or not address:
        raise RequestError("master_address must be the trainer's host name or address.", "master_address")
    values: dict[str, Any] = {"master_address": address}
    for name in ("master_port", "rank_offset", "world_size"):
        value = body.get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise RequestError(f"{name} must be an integer.", name, "invalid_type")
        values[name] = value
    values.update(_optional_fields(body, InitWeightsUpdateGroupReqInput, set(values)))
    obj = InitWeightsUpdateGroupReqInput(**values)
    if not 0 < obj.master_port < 65536:
        raise RequestError("master_port must be a port number (1-65535).", "master_port")
    # The trainer is rank 0 and broadcasts; this server (one rank: no tensor parallelism) takes another.
    if not 0 < obj.rank_offset < obj.world_size:
        raise RequestError(
            f"rank_offset must be this server's rank in the group: 1 to world_size - 1 (rank 0 is the "
            f"trainer's); got {obj.rank_offset} with world_size {obj.world_size}.",
            "rank_offset",
        )
    if obj.backend not in GROUP_BACKENDS:
        raise RequestError(f"backend must be one of {', '.join(GROUP_BACKENDS)}.", "backend")
    if not obj.group_name:
        raise RequestError("group_name must be a non-empty string.", "group_name")
    return obj


def parse_update_weights_from_distributed(body: Any) -> UpdateWeightsFromDistributedReqInput:
    _check_object(body)
    names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
    if not isinstance(names, list) or not names or not all(isinstance(n, str) and n for n in names):
        raise RequestError("names must be a non-empty list of weight names.", "names", "invalid_type")
    if not isinstance(dtypes, list) or len(dtypes) != len(names):
        raise RequestError("dtypes must be a list with a dtype for each name.", "dtypes", "invalid_type")
    dtypes = [d.removeprefix("torch.") if isinstance(d, str) else d for d in dtypes]
    if not all(d in WEIGHT_DTYPES for d in dtypes):
        raise RequestError(f"Each of dtypes must be one of {', '.join(WEIGHT_DTYPES)}.", "dtypes")
    ok = isinstance(shapes, list) and len(shapes) == len(names)
    ok = ok and all(isinstance(s, list) and all(_is_int(d) and d >= 0 for d in s) for s in shapes)
    if not ok:
        raise RequestError("shapes must be a list with a shape (a list of sizes) for each name.", "shapes")
    skip = {"names", "dtypes", "shapes"}
    values = _optional_fields(body, UpdateWeightsFromDistributedReqInput, skip)
    if values.get("load_format") is not None:
        message = "load_format must be null: the weights come by their checkpoint names."
        raise RequestError(message, "load_format")
    return UpdateWeightsFromDistributedReqInput(names, dtypes, shapes, **values)


def parse_destroy_weights_update_group(body: Any) -> DestroyWeightsUpdateGroupReqInput:
    _check_object(body)
    values = _optional_fields(body, DestroyWeightsUpdateGroupReqInput, set())
    return DestroyWeightsUpdateGroupReqInput(**values)


def parse_memory_occupation(body: Any, cls: type) -> Any:
    """A /release_memory_occupation or /resume_memory_occupation body (`cls`): `tags`, a list of
    MEMORY_TAGS (absent, null or empty: all of them)."""
    _check_object(body)
    tags = body.get("tags")
    if tags is not None and (not isinstance(tags, list) or not all(t in MEMORY_TAGS for t in tags)):
        raise RequestError(f"tags must be a list of {', '.join(MEMORY_TAGS)} (or null: all).", "tags")
    return cls(list(dict.fromkeys(tags)) if tags else list(MEMORY_TAGS))


def parse_get_weights_by_name(body: Any) -> GetWeightsByNameReqInput:
    _check_object(body)
    name = body.get("name")
    if not isinstance(name, str) or not name:
        raise RequestError("name must be a parameter's name.", "name", "invalid_type")
    values = _optional_fields(body, GetWeightsByNameReqInput, {"name"})
    if values.get("truncate_size", 1) < 0:
        raise RequestError("truncate_size must be 0 or more.", "truncate_size")
    return GetWeightsByNameReqInput(name, **values)


def _check_object(body: Any) -> None:
    if not isinstance(body, dict):
        raise RequestError("The body must be a JSON object.", None, "invalid_type")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _optional_fields(body: dict, cls: type, skip: set[str]) -> dict[str, Any]:
    """The fields of `cls` other than `skip` that `body` sets (null: the default), each of its default's
    type (str where the default is None); RequestError naming the first that is not."""
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in skip or body.get(f.name) is None:
            continue
        value = body[f.name]
        kind = type(f.default) if f.default is not None else str
        if kind is int and not _is_int(value):
            raise RequestError(f"{f.name} must be an integer.", f.name, "invalid_type")
        if kind is not int and not isinstance(value, kind):
            raise RequestError(f"{f.name} must be a {kind.__name__}.", f.name, "invalid_type")
        values[f.name] = value
    return values


def parse_update_weight_version(body: Any) -> tuple[str, bool]:
    """(new_version, abort_all_requests: default true, as upstream's)."""
    _check_object(body)
    version = body.get("new_version")
    if not isinstance(version, str) or not version:
        raise RequestError("new_version must be a non-empty string.", "new_version", "invalid_type")
    abort = body.get("abort_all_requests", True)
    if not isinstance(abort, bool):
        raise RequestError("abort_all_requests must be a boolean.", "abort_all_requests", "invalid_type")
    return version, abort
