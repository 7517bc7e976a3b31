"""/generate accepts every field of upstream's GenerateReqInput: implemented, ignored, or refused with
400 naming the field when it asks for a feature this server lacks; unknown keys are ignored, as
upstream ignores them."""

from __future__ import annotations

import pytest

from sglang.srt.entrypoints.generate_body import IGNORED, IMPLEMENTED, UNSUPPORTED, parse_generate_body
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import RequestError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")

# Upstream SGLang's GenerateReqInput fields (python/sglang/srt/managers/io_struct.py).
UPSTREAM_FIELDS = """
rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes mm_content_hashes
use_audio_in_video video_config sampling_params return_logprob logprob_start_len top_logprobs_num
token_ids_logprob return_sampling_mask return_text_in_logprobs return_flat_raw_top_logprobs
return_flat_raw_top_logprobs_b64 stream log_metrics return_hidden_states return_routed_experts
routed_experts_start_len return_indexer_topk modalities session_params lora_path lora_id
custom_logit_processor positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room
bootstrap_pair_key decode_tp_size routed_dp_rank data_parallel_rank disagg_prefill_dp_rank kv_router_hint
routing_key conversation_id http_worker_ipc background require_reasoning max_thinking_tokens priority
extra_key no_logs custom_labels return_bytes return_entropy return_prompt_token_ids external_trace_header
received_time need_wait_for_mm_inputs num_items_assigned encoder_urls max_dynamic_patch min_dynamic_patch
image_max_dynamic_patch video_max_dynamic_patch images_config multi_item_delimiter_indices cache_salt
""".split()


def test_every_upstream_field_is_classified_once():
    groups = [IMPLEMENTED, IGNORED, set(UNSUPPORTED)]
    for name in UPSTREAM_FIELDS:
        assert sum(name in g for g in groups) == 1, name
    assert not (IMPLEMENTED | IGNORED | set(UNSUPPORTED)) - set(UPSTREAM_FIELDS)


def test_unset_upstream_fields_and_router_fields_are_accepted():
    body = (
        b'{"text": "hi", "lora_path": "", "return_hidden_states": false, "image_data": null,'
        b' "stream_options": {"include_usage": true}, "log_metrics": true, "no_logs": false,'
        b' "background": false, "return_bytes": false, "return_entropy": false,'
        b' "bootstrap_host": "10.0.0.1", "bootstrap_port": 8998, "bootstrap_room": 12345,'
        b' "routed_dp_rank": 0, "priority": 3, "custom_labels": {"team": "a"}, "whatever": [1, 2]}'
    )
    obj = parse_generate_body(body)
    assert obj.text == "hi" and obj.log_metrics


@pytest.mark.parametrize(
    "field, value",
    [
        ("lora_id", '"my-adapter-id"'),
        ("audio_data", '"x.wav"'),
        ("return_entropy", "true"),
        ("return_bytes", "true"),
        ("background", "true"),
        ("return_sampling_mask", "true"),
    ],
)
def test_a_feature_this_server_lacks_is_refused_naming_the_field(field, value):
    with pytest.raises(RequestError) as e:
        parse_generate_body(f'{{"text": "hi", "{field}": {value}}}'.encode())
    assert e.value.param == field
    assert e.value.message.startswith(f"{field} is not supported")


def test_a_multimodal_field_beside_image_and_video_data_is_refused_for_what_it_asks():
    """image_data and video_data are served: the refusal of upstream's other multimodal fields names
    what they ask for (it said 'this server has no multimodal input', false on a vision-language
    server)."""
    with pytest.raises(RequestError) as e:
        parse_generate_body(b'{"text": "hi", "video_config": {"fps": 1}}')
    assert e.value.param == "video_config" and "per-request video settings" in e.value.message
    assert not any("multimodal input" in reason for reason in UNSUPPORTED.values())


@pytest.mark.parametrize(
    "flags, value, words",
    [
        ({}, True, "--enable-return-hidden-states"),
        (
            {"enable_return_hidden_states": True, "disaggregation_mode": "decode"},
            True,
            "--disaggregation-mode",
        ),
        ({"enable_return_hidden_states": True}, 1, "must be a boolean"),
        ({"enable_return_hidden_states": True}, [True, "yes"], "must be a boolean"),
    ],
)
def test_return_hidden_states_needs_the_flag_and_a_boolean(flags, value, words):
    """Upstream's rule: without --enable-return-hidden-states a request asking is a 400 naming the field;
    a PD server refuses it too (the prompt's rows would stay on the prefill server)."""
    from types import SimpleNamespace

    from sglang.srt.managers.request_validation import (
        RequestLimits,
        build_requests,
        hidden_states_refused,
        parse_prompts,
    )  # fmt: skip

    args = SimpleNamespace(**{"enable_return_hidden_states": False, "disaggregation_mode": "null", **flags})
    limits = RequestLimits(64, 63, 512, hidden_states_refused(args))
    obj = GenerateReqInput(input_ids=[[5, 6], [7, 8]], return_hidden_states=value)
    with pytest.raises(RequestError) as e:
        build_requests(obj, parse_prompts(obj), [], limits)
    assert e.value.param == "return_hidden_states" and words in e.value.message, e.value.message
    ok = SimpleNamespace(enable_return_hidden_states=True, disaggregation_mode="null")
    limits = RequestLimits(64, 63, 512, hidden_states_refused(ok))
    for value in ([True, False], [True, None]):  # (null: the default, as for every per-prompt field)
        obj = GenerateReqInput(input_ids=[[5, 6], [7, 8]], return_hidden_states=value)
        reqs, _ = build_requests(obj, parse_prompts(obj), [], limits)
        assert [r.req.return_hidden_states for r in reqs] == [True, False]


def test_routed_experts_are_asked_for_from_position_zero_only():
    """return_routed_experts is served (with --enable-return-routed-experts); upstream's
    routed_experts_start_len is taken as 0 only: the reply holds every position's routing."""
    obj = parse_generate_body(b'{"text": "hi", "return_routed_experts": true, "routed_experts_start_len": 0}')
    assert obj.return_routed_experts is True
    with pytest.raises(RequestError) as e:
        parse_generate_body(b'{"text": "hi", "return_routed_experts": true, "routed_experts_start_len": 5}')
    assert e.value.param == "routed_experts_start_len" and "every position from 0" in e.value.message
