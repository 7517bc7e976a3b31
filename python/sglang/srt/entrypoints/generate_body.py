"""The native /generate body: every field of upstream SGLang's `GenerateReqInput` is accepted.

Each upstream field is either implemented (`GenerateReqInput` here), ignored because it changes nothing
on this server (routing and tracing hints, logging switches, the bootstrap fields the sglang-router adds
for PD disaggregation other than host, port and room), or names a feature this server lacks: that one is refused with HTTP 400 when it
is set to anything but an empty value (null, false, "", [], {}), which clients send for "unset".
Keys that upstream does not know are ignored, as upstream's request parsing ignores them.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import orjson

from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import RequestError

IMPLEMENTED = frozenset(f.name for f in fields(GenerateReqInput))

IGNORED = frozenset(
    {
        # routing, sessions and tracing
        "session_id",
        "routed_dp_rank",
        "data_parallel_rank",
        "disagg_prefill_dp_rank",
        "kv_router_hint",
        "routing_key",
        "conversation_id",
        "http_worker_ipc",
        "external_trace_header",
        "received_time",
        "custom_labels",
        "no_logs",
        # prefill/decode disaggregation (bootstrap_host/port/room are implemented)
        "bootstrap_pair_key",
        "decode_tp_size",
        # with return_routed_experts: 0 only (every position's routing is returned; checked below)
        "routed_experts_start_len",
    }
)

UNSUPPORTED = {
    "input_embeds": "input embeddings",
    # image_data and video_data are served (Qwen3.5 vision-language checkpoints); these are not
    "audio_data": "audio input",
    "mm_hashes": "precomputed multimodal hashes",
    "mm_content_hashes": "precomputed multimodal hashes",
    "use_audio_in_video": "audio input",
    "video_config": "per-request video settings (the checkpoint's video processor settings apply)",
    "modalities": "per-request modality hints",
    "need_wait_for_mm_inputs": "encoder disaggregation",
    "num_items_assigned": "encoder disaggregation",
    "encoder_urls": "encoder disaggregation",
    "max_dynamic_patch": "dynamic image patching",
    "min_dynamic_patch": "dynamic image patching",
    "image_max_dynamic_patch": "dynamic image patching",
    "video_max_dynamic_patch": "dynamic image patching",
    "images_config": "per-request image settings (the checkpoint's image processor settings apply)",
    "lora_id": "LoRA adapter ids (name the adapter in lora_path)",
    "positional_embed_overrides": "embedding overrides",
    "return_sampling_mask": "sampling masks",
    "return_flat_raw_top_logprobs": "flat top logprobs",
    "return_flat_raw_top_logprobs_b64": "flat top logprobs",
    "return_indexer_topk": "indexer top-k",
    "return_entropy": "entropy",
    "return_bytes": "image generation",
    "multi_item_delimiter_indices": "multi-item scoring",
    "background": "background requests",
}


def is_empty(value: Any) -> bool:
    """What clients send for "unset": null, false, "", [], {}, or a list of such values. A number is
    a setting (0 thinking tokens is a budget), so it is not empty."""
    if value is None or value is False or value == "" or value == {}:
        return True
    return isinstance(value, list) and all(is_empty(v) for v in value)


def parse_generate_body(body: bytes) -> GenerateReqInput:
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        raise RequestError(f"The request body is not valid JSON: {e}.", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise RequestError("The request body must be a JSON object.", None, "invalid_type")
    for name, value in data.items():
        if name in UNSUPPORTED and not is_empty(value):
            raise RequestError(
                f"{name} is not supported: this server has no {UNSUPPORTED[name]}; leave it out or send null.",
                name,
                "unsupported_parameter",
            )
    if data.get("routed_experts_start_len") not in (None, 0):
        raise RequestError(
            "routed_experts_start_len is not supported: meta_info.routed_experts holds every position from "
            "0; leave it out or send 0.",
            "routed_experts_start_len",
            "unsupported_parameter",
        )
    # null means "the default" for the implemented fields too.
    return GenerateReqInput(**{k: v for k, v in data.items() if k in IMPLEMENTED and v is not None})
