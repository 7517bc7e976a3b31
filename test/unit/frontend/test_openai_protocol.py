"""OpenAI protocol: request validation messages, mapping to native requests, reply formats, SSE framing."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import orjson
import pytest

from sglang.srt.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionStreamResponse,
    ChatStreamChoice,
    CompletionRequest,
    DeltaMessage,
)
from sglang.srt.entrypoints.openai.serving_base import SSE_DONE, parse_model, sse, sse_stream, usage
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat, chat_logprobs
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion, completion_logprobs
from sglang.srt.managers.request_validation import RequestError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


@pytest.mark.parametrize(
    "body, param, code",
    [
        (b'{"prompt": "x", "max_tokens": -1}', "max_tokens", "invalid_value"),
        (b'{"prompt": "x", "max_tokens": "three"}', "max_tokens", "invalid_type"),
        (b'{"prompt": "x", "max_tokens": 2.5}', "max_tokens", "invalid_value"),
        (b'{"prompt": "x", "temperature": -0.1}', "temperature", "invalid_value"),
        (b'{"prompt": "x", "top_p": 0}', "top_p", "invalid_value"),
        (b'{"prompt": "x", "top_k": 0}', "top_k", "invalid_value"),
        (b'{"prompt": "x", "stop": 3}', "stop", "invalid_type"),
        (b'{"prompt": {"a": 1}}', "prompt", "invalid_value"),
        (b'{"prompt": [[1], "a"]}', "prompt", "invalid_value"),
        (b'{"max_tokens": 3}', "prompt", "missing_required_parameter"),
        # (served on /generate only; the OpenAI replies have no place upstream's clients read it from)
        (b'{"prompt": "x", "return_routed_experts": true}', "return_routed_experts", "unsupported_parameter"),
        (b'{"prompt": "x"', None, "invalid_json"),
        (b'"just a string"', None, "invalid_type"),
    ],
)
def test_completion_request_errors(body, param, code):
    with pytest.raises(RequestError) as e:
        parse_model(CompletionRequest, body)
    assert (e.value.param, e.value.code) == (param, code)
    if param:
        assert e.value.message.startswith(param)


def test_values_upstream_takes_are_taken():
    """Upstream's request models validate in pydantic's lax mode: numbers as strings, whole floats for
    integers and booleans for counts are converted, not refused."""
    req = parse_model(
        CompletionRequest,
        b'{"prompt": "x", "max_tokens": 5.0, "temperature": "0.5", "logprobs": true, "stream": "true"}',
    )
    assert (req.max_tokens, req.temperature, req.logprobs, req.stream) == (5, 0.5, 1, True)
    assert type(req.max_tokens) is int and type(req.logprobs) is int


def test_chat_errors_name_nested_fields():
    cases = {
        b'{"messages": [{"role": "robot", "content": "x"}]}': "messages[0].role",
        b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 1}]}': "messages[1].content",
        b'{"messages": []}': "messages",
        b'{"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}': "top_logprobs",
    }
    for body, param in cases.items():
        with pytest.raises(RequestError) as e:
            parse_model(ChatCompletionRequest, body)
        assert e.value.param == param, body


def test_completion_request_maps_to_native():
    serving = OpenAIServingCompletion(None, "m")
    req = parse_model(
        CompletionRequest,
        b'{"prompt": [[5, 6], [7]], "max_tokens": 4, "temperature": 0, "seed": 3, "stop": "x", "logprobs": 2, "n": 2}',
    )
    obj = asyncio.run(serving.to_generate_input(req))
    assert obj.text is None and obj.input_ids == [[5, 6], [7]]
    assert obj.sampling_params == {
        "max_new_tokens": 4,
        "temperature": 0,
        "n": 2,
        "stop": "x",
        "seed": 3,
        "ignore_eos": False,
        "no_stop_trim": False,
        "skip_special_tokens": True,
    }
    assert obj.return_logprob and obj.top_logprobs_num == 2 and obj.return_text_in_logprobs


class _TemplateTokenizer:
    """A tokenizer whose chat template writes `role: content` lines (and the variables it was given)."""

    chat_template = "(role: content lines)"

    def __init__(self):
        self.kwargs = None

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, **kwargs):
        self.kwargs = kwargs
        lines = [f"{m['role']}: {m['content']}" for m in messages] + [f"{k}={v}" for k, v in kwargs.items()]
        return "\n".join(lines) + ("\nassistant: " if add_generation_prompt else "")


def _chat_serving(context_len: int = 100, sampling_defaults=None) -> tuple[OpenAIServingChat, list[str]]:
    """Chat serving over a fake tokenizer manager whose `encode` gives one id per character (the texts
    it encoded go to the returned list)."""
    encoded: list[str] = []

    async def encode(text, param, add_special_tokens=True, truncate=False):
        encoded.append(text)
        return [ord(c) % 50 for c in text]

    tm = SimpleNamespace(
        tokenizer=_TemplateTokenizer(), encode=encode, limits=SimpleNamespace(context_len=context_len)
    )
    return OpenAIServingChat(tm, "m", sampling_defaults), encoded


def _chat_input(serving: OpenAIServingChat, body: dict):
    return asyncio.run(serving.to_generate_input(parse_model(ChatCompletionRequest, orjson.dumps(body))))


def test_chat_without_max_tokens_may_run_to_the_context_length():
    serving, _ = _chat_serving(context_len=100)
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    obj = _chat_input(serving, hi)
    assert obj.sampling_params["max_new_tokens"] == 100 - len(obj.input_ids), "not /generate's 128"
    assert _chat_input(serving, {**hi, "max_tokens": 5}).sampling_params["max_new_tokens"] == 5
    obj = _chat_input(serving, {**hi, "min_tokens": 500})
    room = 100 - len(obj.input_ids)
    assert (obj.sampling_params["max_new_tokens"], obj.sampling_params["min_new_tokens"]) == (room, room)
    both = {**hi, "max_tokens": 10, "max_completion_tokens": 3}
    assert _chat_input(serving, both).sampling_params["max_new_tokens"] == 3, "the newer name wins"
    # /v1/completions keeps OpenAI's default of 16.
    req = parse_model(CompletionRequest, b'{"prompt": [5, 6]}')
    assert (
        asyncio.run(OpenAIServingCompletion(None, "m").to_generate_input(req)).sampling_params[
            "max_new_tokens"
        ]
        == 16
    )


def test_chat_template_kwargs_and_continue_final_message():
    serving, encoded = _chat_serving()
    user = {"role": "user", "content": "hi"}
    _chat_input(serving, {"messages": [user], "chat_template_kwargs": {"enable_thinking": False}})
    assert serving.tm.tokenizer.kwargs == {"enable_thinking": False}
    assert encoded[-1] == "user: hi\nenable_thinking=False\nassistant: "
    started = {"role": "assistant", "content": "Once upon"}
    _chat_input(serving, {"messages": [user, started], "continue_final_message": True})
    assert encoded[-1] == "user: hi\nassistant: Once upon", "the answer goes on from the last message"
    _chat_input(serving, {"messages": [user, started]})
    assert encoded[-1] == "user: hi\nassistant: Once upon\nassistant: ", "without the flag: a new turn"
    with pytest.raises(RequestError) as e:
        _chat_input(serving, {"messages": [user], "chat_template_kwargs": {"tokenize": True}})
    assert e.value.param == "chat_template_kwargs" and "tokenize" in e.value.message
    # An answer that goes on from an assistant message alone.
    _chat_input(serving, {"messages": [started], "continue_final_message": True})
    assert encoded[-1] == "\nassistant: Once upon"


def test_reasoning_effort_switches_the_templates_thinking():
    """OpenAI's reasoning_effort (and the Responses API's reasoning.effort), upstream's mapping: "none"
    turns the template's thinking off, any other level on; the request's own chat_template_kwargs win."""
    serving, _ = _chat_serving()
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    for effort, thinking in [("none", False), ("high", True), (0.5, True), (0, True)]:
        _chat_input(serving, {**hi, "reasoning_effort": effort})
        assert serving.tm.tokenizer.kwargs == {"enable_thinking": thinking}, effort
    _chat_input(serving, {**hi, "reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": True}})
    assert serving.tm.tokenizer.kwargs == {"enable_thinking": True}
    _chat_input(serving, hi)
    assert serving.tm.tokenizer.kwargs == {}
    for bad in ("huge", 1.5, 0.995):
        with pytest.raises(RequestError) as e:
            _chat_input(serving, {**hi, "reasoning_effort": bad})
        assert e.value.param == "reasoning_effort"
    from sglang.srt.entrypoints.openai.responses_protocol import ResponsesRequest

    responses = ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": "none"}})
    assert responses.chat_request([{"role": "user", "content": "hi"}]).reasoning_effort == "none"
    HI = [{"role": "user", "content": "hi"}]  # noqa: N806
    for bad in ("bogus", 0.5, True):  # (named as the Responses API names it; a level only there)
        with pytest.raises(RequestError) as e:
            ResponsesRequest.model_validate({"input": "hi", "reasoning": {"effort": bad}}).chat_request(HI)
        assert e.value.param == "reasoning.effort", bad


def test_token_in_token_out_fields_and_pretokenized_prompts():
    """Each choice's prompt_token_ids / response_token_ids / meta_info where asked; input_ids in place of
    the template (a 400 naming it with an image; its own name in the native checks' errors; whether it
    leaves a think block open is read from its tokens); the stream refusal names the field."""
    from types import SimpleNamespace

    from sglang.test.fake_chat import FakeChatTokenizerManager

    tm = FakeChatTokenizerManager("ok")
    serving = OpenAIServingChat(tm, "m", reasoning_parser="qwen3")

    def reply(body: dict):
        async def read():
            return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **body})

        request = SimpleNamespace(body=read, url=SimpleNamespace(path="/v1/chat/completions"), is_disconnected=None)
        return orjson.loads(asyncio.run(serving.handle(request)).body)

    (choice,) = reply({"return_token_ids": True, "return_meta_info": True})["choices"]
    assert choice["response_token_ids"] == [ord("o"), ord("k")] and choice["prompt_token_ids"] == tm.prompts[-1]
    assert choice["meta_info"]["completion_tokens"] == 2
    plain = reply({})["choices"][0]
    assert not {"prompt_token_ids", "response_token_ids", "meta_info"} & set(plain)
    ids = [ord(c) for c in "<think>\n"]
    reply({"input_ids": ids, "regex": "[0-9]+"})
    assert tm.prompts[-1] == ids  # the template bypassed
    obj = asyncio.run(serving.to_generate_input(parse_model(ChatCompletionRequest, orjson.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "input_ids": ids}))))  # fmt: skip
    assert obj.require_reasoning, "its tokens leave a think block open"
    image = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,x"}}]}
    with pytest.raises(RequestError) as e:
        reply({"messages": [image], "input_ids": [5]})
    assert e.value.param == "input_ids"
    req = parse_model(ChatCompletionRequest, orjson.dumps({"model": "m", "messages": [image], "input_ids": [5]}))
    assert serving.rename(RequestError("input_ids[0] = -1 is outside", "input_ids"), req).param == "input_ids"
    assert serving.rename(RequestError("input_ids is too long", "input_ids")).param == "messages"
    for bad in ([True, 5], ["7"], [1.0]):  # (as /generate refuses them: not token ids)
        with pytest.raises(RequestError) as e:
            reply({"input_ids": bad})
        assert e.value.param.startswith("input_ids"), bad
    for name in ("return_prompt_token_ids", "return_token_ids", "return_meta_info"):
        with pytest.raises(RequestError) as e:
            reply({name: True, "stream": True})
        assert e.value.param == name and "stream=false" in e.value.message
    with pytest.raises(RequestError) as e:
        reply({"reasoning_effort": False})
    assert e.value.param == "reasoning_effort"


def test_chat_template_kwargs_are_template_variables_only():
    """Not the arguments of transformers' `apply_chat_template` (the real tokenizer's): `chat_template`
    would render a template the request brings on the server, `tools` would pass the tools refusal."""
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    serving, _ = _chat_serving()
    serving.tm.tokenizer = get_tokenizer("tiny-qwen3-next")
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    for name, value in [
        ("chat_template", "{{ 7 * 7 }}"),
        ("tools", [{"type": "function"}]),
        ("documents", []),
    ]:
        with pytest.raises(RequestError) as e:
            _chat_input(serving, {**hi, "chat_template_kwargs": {name: value}})
        assert e.value.param == "chat_template_kwargs" and name in e.value.message
    _chat_input(serving, {**hi, "chat_template_kwargs": {"enable_thinking": False}})  # a variable: fine


def test_sampling_defaults_model_takes_the_checkpoints_generation_config(tmp_path):
    import json

    from sglang.srt.sampling.model_defaults import model_sampling_defaults
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    assert model_sampling_defaults(str(tmp_path)) == {}, "no generation_config.json: nothing"
    config = {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0}
    (tmp_path / "generation_config.json").write_text(json.dumps({**config, "repetition_penalty": 1.05}))
    defaults = model_sampling_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.0, "repetition_penalty": 1.05}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 0}))
    assert model_sampling_defaults(str(tmp_path)) == {"top_k": -1}, "transformers' top_k 0 is off"

    serving, _ = _chat_serving(sampling_defaults=defaults)
    hi = {"messages": [{"role": "user", "content": "hi"}]}
    params = _chat_input(serving, hi).sampling_params
    assert {k: params[k] for k in defaults} == defaults
    params = _chat_input(serving, {**hi, "temperature": 0, "top_k": 5}).sampling_params
    assert (params["temperature"], params["top_k"], params["top_p"]) == (0, 5, 0.95), "the request's win"
    # A value no request could send is left out (else every chat leaving the field unset would fail);
    # a whole float for top_k is its integer; a file that is not a JSON object gives no defaults.
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"top_k": 20.0, "temperature": "0.7", "top_p": 0})
    )
    assert model_sampling_defaults(str(tmp_path)) == {"top_k": 20}
    (tmp_path / "generation_config.json").write_text("[1, 2")
    assert model_sampling_defaults(str(tmp_path)) == {}
    assert ServerArgs().sampling_defaults == "model", "upstream's default"
    assert prepare_server_args(["--sampling-defaults", "openai"]).sampling_defaults == "openai"


CHAT = {"messages": [{"role": "user", "content": "x"}]}
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "extra, grammar",
    [
        ({"regex": "[0-9]+"}, ("regex", "[0-9]+")),
        ({"ebnf": 'root ::= "x"'}, ("ebnf", 'root ::= "x"')),
        ({"json_schema": SCHEMA}, ("json_schema", json.dumps(SCHEMA))),  # an object becomes its text
        ({"json_schema": '{"type": "string"}'}, ("json_schema", '{"type": "string"}')),
        ({"response_format": {"type": "json_object"}}, ("json_schema", '{"type": "object"}')),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}},
            ("json_schema", json.dumps(SCHEMA)),
        ),
        ({"response_format": {"type": "text"}}, None),
        ({"regex": None, "response_format": None}, None),  # what clients send for "unset"
    ],
)
def test_grammar_fields_reach_the_sampling_params(extra, grammar):
    """Upstream's mapping: response_format json_object is any JSON object, json_schema its schema; the
    regex / ebnf / json_schema extensions as they are. Completions and chat alike."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    for model, body in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, CHAT)):
        params = parse_model(model, orjson.dumps({**body, **extra})).sampling_params()
        got = [(k, params[k]) for k in ("json_schema", "regex", "ebnf", "structural_tag") if k in params]
        assert got == ([grammar] if grammar else [])


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"json_schema": "{bad"}, "json_schema", "not JSON"),
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "ebnf", "cannot be set together with regex"),
        ({"response_format": {"type": "json_object"}, "regex": "a"}, "regex", "with response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format", "'yaml' is not one of"),
        ({"response_format": {"type": "json_schema", "json_schema": {}}}, "response_format", "schema"),
        ({"regex": 5}, "regex", "string"),
    ],
)
def test_bad_grammar_fields_are_a_400_naming_the_field(extra, param, words):
    """What is wrong without parsing the grammar (the scheduler parses and compiles it: a grammar xgrammar
    refuses is a 400 from there, named by the field it came from: test_openai_api)."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest

    for model, body in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, CHAT)):
        with pytest.raises(RequestError) as e:
            parse_model(model, orjson.dumps({**body, **extra}))
        assert e.value.param == param and words in e.value.message, e.value.message


def test_penalties_logit_bias_and_no_stop_trim_reach_the_sampling_params():
    extra = {"frequency_penalty": 0.5, "presence_penalty": -1, "repetition_penalty": 1.1,
             "logit_bias": {"12": -3.5}, "no_stop_trim": True}  # fmt: skip
    chat = {"messages": [{"role": "user", "content": "x"}]}
    for model, body in ((CompletionRequest, {"prompt": "x"}), (ChatCompletionRequest, chat)):
        params = parse_model(model, orjson.dumps({**body, **extra})).sampling_params()
        assert {k: params[k] for k in extra} == extra


def test_native_errors_are_renamed_to_openai_fields():
    chat = OpenAIServingChat(None, "m")
    err = chat.rename(
        RequestError("max_new_tokens 9 plus the 3 input tokens exceeds ...", "sampling_params.max_new_tokens")
    )
    assert err.param == "max_tokens" and err.message.startswith("max_tokens 9")
    err = OpenAIServingCompletion(None, "m").rename(
        RequestError("input_ids[1] = 999 is outside", "input_ids")
    )
    assert err.param == "prompt" and err.message.startswith("prompt[1]")
    err = OpenAIServingCompletion(None, "m").rename(
        RequestError("The input text (5000 tokens) is longer than the model's context length", "text")
    )
    assert err.param == "prompt"
    assert err.message == "The input prompt (5000 tokens) is longer than the model's context length", (
        "whole words are renamed; words containing a field name (context) are left alone"
    )


META = {
    "output_token_logprobs": [[-0.5, 10, "ab"], [-1.0, 11, "é"]],
    "output_top_logprobs": [[[-0.5, 10, "ab"], [-2.0, 12, "c"]], [[-1.0, 11, "é"], [-1.5, 13, "d"]]],
}


def test_logprob_formats():
    lp, end = completion_logprobs(META, 0, 0, True)
    assert lp.tokens == ["ab", "é"] and lp.token_logprobs == [-0.5, -1.0]
    assert lp.text_offset == [0, 2] and end == 3
    assert lp.top_logprobs == [{"ab": -0.5, "c": -2.0}, {"é": -1.0, "d": -1.5}]
    tail, _ = completion_logprobs(META, 1, 2, False)
    assert tail.tokens == ["é"] and tail.text_offset == [2] and tail.top_logprobs == [None]
    chat = orjson.loads(orjson.dumps(chat_logprobs(META, 0).model_dump()))  # (what a reply writes)
    # (the plain forms too: the replies' fast path, an orjson piece, is model_dump's python mode only)
    assert json.loads(chat_logprobs(META, 0).model_dump_json()) == chat == chat_logprobs(META, 0).model_dump(mode="json")
    assert chat["content"][1]["bytes"] == [0xC3, 0xA9]
    assert [t["token"] for t in chat["content"][0]["top_logprobs"]] == ["ab", "c"]


def test_usage_counts_each_prompt_once():
    outs = [
        {"meta_info": {"prompt_tokens": 5, "completion_tokens": c, "cached_tokens": 2}} for c in (3, 4, 1, 1)
    ]
    u = usage(outs, n=2)
    assert u == {
        "prompt_tokens": 10,
        "completion_tokens": 9,
        "total_tokens": 19,
        "prompt_tokens_details": {"cached_tokens": 4},
    }


def test_sse_framing_and_deltas():
    chunk = ChatCompletionStreamResponse(
        id="c", model="m", choices=[ChatStreamChoice(index=0, delta=DeltaMessage(content="hi"))]
    )
    raw = sse(chunk)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    body = orjson.loads(raw[len(b"data: ") :])
    assert body["choices"][0]["delta"] == {"content": "hi"}, "no null role in a delta"
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_chat_stream_ends_each_choice_with_a_finish_chunk_and_echoes_the_model():
    """As upstream: the text's chunks carry no finish reason; a chunk of its own with an empty delta
    does. Replies name the model the request named (the served name when it named none)."""
    serving, _ = _chat_serving()
    req = parse_model(
        ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "stream": true}'
    )
    chunks = [
        {"text": "He", "meta_info": {"id": "r", "finish_reason": None}},
        {"text": "Hello", "meta_info": {"id": "r", "finish_reason": {"type": "stop", "matched": 7}}},
    ]

    async def rest():
        yield chunks[1]

    async def collect(req):
        return [orjson.loads(e[6:]) async for e in serving.stream_events(req, None, chunks[0], rest())]

    events = asyncio.run(collect(req))
    choices = [e["choices"][0] for e in events]
    assert [c["delta"] for c in choices] == [{"role": "assistant", "content": ""}, {"content": "He"},
                                             {"content": "llo"}, {}]  # fmt: skip
    assert [c["finish_reason"] for c in choices] == [None, None, None, "stop"]
    assert choices[-1]["matched_stop"] == 7 and choices[2]["matched_stop"] is None
    assert {e["model"] for e in events} == {"m"}
    named = parse_model(
        ChatCompletionRequest, b'{"model": "my-model", "messages": [{"role": "user", "content": "x"}]}'
    )
    assert {e["model"] for e in asyncio.run(collect(named))} == {"my-model"}
    # An ending that adds no text and no logprob entries (an abort) is the finish chunk alone.
    with_logprobs = parse_model(
        ChatCompletionRequest, b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true}'
    )
    chunks[1] = {"text": "He", "meta_info": {"id": "r", "finish_reason": {"type": "abort"}}}
    choices = [e["choices"][0] for e in asyncio.run(collect(with_logprobs))]
    assert [c["finish_reason"] for c in choices] == [None, None, "abort"] and choices[-1]["delta"] == {}


def test_sse_stream_ends_with_done_even_after_an_error():
    async def events():
        yield b"data: 1\n\n"
        raise RuntimeError("boom")

    async def collect():
        return [e async for e in sse_stream(events())]

    out = asyncio.run(collect())
    assert out[0] == b"data: 1\n\n"
    assert orjson.loads(out[1][6:])["error"]["type"] == "server_error"
    assert out[-1] == SSE_DONE
