"""Any request body gets a request or a 400 naming its field, never another error (a 500): random JSON
values in every field of /generate's body and its sampling_params, and of the OpenAI completion and chat
bodies, through the same parsing and normalisation the server runs (no model needed). Each example is
a valid body with a few fields replaced, since validation stops at the first bad one. It fails on the
logit_bias key "--5" that raised a ValueError (a 500) before 35e0782."""

from __future__ import annotations

import asyncio
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sglang.srt.entrypoints.generate_body import parse_generate_body
from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from sglang.srt.entrypoints.openai.serving_base import parse_model
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.managers.io_struct import GenerateReqInput
from sglang.srt.managers.request_validation import RequestError, RequestLimits, normalize_generate_request
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="per-commit-cpu")

LIMITS = RequestLimits(context_len=64, max_req_input_len=63, vocab_size=512)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 5, 511, 512, 10**20]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, 0.5, 1.0, 1e39, -1e39, 1e-300]),
    st.text(max_size=8), st.sampled_from(["", "5", "--5", "x", "(a", "[0-9]+", "²"]),
)  # fmt: skip
keys = st.one_of(st.text(max_size=4), st.sampled_from(["5", "--5", "²", "-1", "600", "seed"]))
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(keys, inner, max_size=3),
    max_leaves=8,
)  # fmt: skip
SAMPLING_KEYS = [f.name for f in SamplingParams.__dataclass_fields__.values()] + ["seed"]
# Few fields at a time (validation stops at the first bad one), and the maps' keys where they matter.
sampling_params = st.one_of(
    st.dictionaries(st.sampled_from(SAMPLING_KEYS), json_values, max_size=3),
    st.fixed_dictionaries({"logit_bias": st.dictionaries(keys, scalars, max_size=3)}),
)
generate_keys = ["text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
                 "top_logprobs_num", "token_ids_logprob", "stream", "rid", "return_text_in_logprobs"]  # fmt: skip
OPENAI_KEYS = [name for name in CompletionRequest.model_fields if name not in ("prompt", "messages")]
# What an error may name besides the body's own keys: a field it lacks (bootstrap_host with a room).
FIELDS = {*GenerateReqInput.__dataclass_fields__, *CompletionRequest.model_fields, *ChatCompletionRequest.model_fields}


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer("tiny-qwen3-next")


def _run(fn, body: dict) -> None:
    """fn() returns or raises RequestError (a 400) naming a field of `body`; anything else fails."""
    try:
        fn()
    except RequestError as e:
        root = (e.param or "").split(".")[0].split("[")[0]
        assert e.message and (root in body or root in FIELDS), (e.param, e.message)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(generate_keys), json_values, max_size=2), sampling=sampling_params)
def test_any_generate_body_is_a_request_or_a_named_400(tokenizer, fields, sampling):
    # A valid body with a few fields replaced (validation stops at the first bad one).
    body = {"input_ids": [5, 6], "sampling_params": sampling, **fields}
    raw = json.dumps(body, allow_nan=False).encode()
    _run(lambda: normalize_generate_request(parse_generate_body(raw), tokenizer, LIMITS), body)


class _TokenizerManager:
    """What `to_generate_input` reads of the tokenizer manager: the tokenizer (the chat template), its
    `encode` and the model's limits."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.limits = LIMITS

    async def encode(self, text, param, add_special_tokens=True, truncate=False):
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)


CHAT_KEYS = [name for name in ChatCompletionRequest.model_fields if name not in OPENAI_KEYS]
# Chat fields in valid and odd shapes: tools, a conversation with calls, template variables.
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALLED = {"role": "assistant", "content": None, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{"}}]}
chat_values = st.one_of(
    json_values,
    st.just([TOOL]),
    st.just([{"role": "user", "content": "hi"}, CALLED, {"role": "tool", "tool_call_id": "c", "content": "x"}]),
    st.just([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "<think>"}]),
    st.sampled_from(["auto", "none", "required"]),
    st.dictionaries(st.sampled_from(["enable_thinking", "tools", "x"]), scalars, max_size=2),
)


@settings(max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    extra=st.dictionaries(st.sampled_from(OPENAI_KEYS), json_values, max_size=2),
    chat_extra=st.dictionaries(st.sampled_from(CHAT_KEYS), chat_values, max_size=3),
    chat=st.booleans(),
    sampling=sampling_params,
)
def test_any_openai_body_is_a_request_or_a_named_400(tokenizer, extra, chat_extra, chat, sampling):
    body = {**({"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": [5, 6]}), **extra}
    body |= {k: v for k, v in sampling.items() if k in OPENAI_KEYS}
    if chat:
        body |= chat_extra
    parsers = {"reasoning_parser": "qwen3", "tool_call_parser": "qwen25"}
    model, serving = (
        (ChatCompletionRequest, OpenAIServingChat(_TokenizerManager(tokenizer), "m", **parsers))
        if chat
        else (CompletionRequest, OpenAIServingCompletion(_TokenizerManager(tokenizer), "m"))
    )

    def check():
        req = parse_model(model, json.dumps(body, allow_nan=False).encode())
        obj = asyncio.run(serving.to_generate_input(req))
        try:
            normalize_generate_request(obj, tokenizer, LIMITS)
        except RequestError as e:
            raise serving.rename(e) from None  # native names to OpenAI's, as the server answers

    _run(check, body)
