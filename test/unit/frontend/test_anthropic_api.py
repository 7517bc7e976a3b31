"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) over the chat serving, with
a fake template and a fake generation: content blocks to chat messages, the request to a chat request,
the answer to content blocks and stream events that the `anthropic` package's own models parse and its
own stream accumulator builds into exactly the whole reply, Anthropic's error bodies and stop reasons.
The real server: test/registered/openai_server/test_openai_api.py (`test_anthropic_messages_api`)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import orjson
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from anthropic.types import Message, RawMessageStreamEvent
from pydantic import TypeAdapter

from sglang.srt.entrypoints.anthropic.protocol import MessagesRequest
from sglang.srt.entrypoints.anthropic.serving import AnthropicServing
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.managers.request_validation import RequestError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_chat import FakeChatTokenizerManager

register_cpu_ci(est_time=3, suite="per-commit-cpu")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"name": "get_weather", "description": "Weather.", "input_schema": {"type": "object"}}]
EVENTS = TypeAdapter(RawMessageStreamEvent)
USER = [{"role": "user", "content": "weather?"}]


def _serving(answer: str = "Hello there", **tm_kw) -> AnthropicServing:
    tm = FakeChatTokenizerManager(answer, **tm_kw)
    return AnthropicServing(OpenAIServingChat(tm, "m", reasoning_parser="qwen3", tool_call_parser="qwen25"))


def _request(body: dict | bytes, path: str = "/v1/messages") -> SimpleNamespace:
    async def read():
        return body if isinstance(body, bytes) else orjson.dumps(body)

    return SimpleNamespace(body=read, url=SimpleNamespace(path=path), is_disconnected=None)


def _create(serving: AnthropicServing, **body) -> tuple[int, object]:
    async def run():
        reply = await serving.messages(_request({"messages": USER, "max_tokens": 64, **body}))
        if not body.get("stream"):
            return reply.status_code, orjson.loads(reply.body)
        return reply.status_code, [_event(chunk) async for chunk in reply.body_iterator]

    return asyncio.run(run())


def _event(chunk: bytes) -> dict:
    head, data = chunk.decode().split("\n", 1)
    event = json.loads(data.removeprefix("data: "))
    assert head == f"event: {event['type']}"
    if event["type"] not in ("error", "ping"):  # (the anthropic client skips pings before its models)
        EVENTS.validate_python(event)  # the anthropic package's own event models parse it
    return event


def _accumulated(events: list[dict]) -> dict:
    """The message the anthropic package's own stream accumulator builds from the events."""
    snapshot, bufs = None, {}
    for event in [e for e in events if e["type"] != "ping"]:
        snapshot = accumulate_event(event=EVENTS.validate_python(event), current_snapshot=snapshot, json_bufs=bufs)
    out = snapshot.model_dump(exclude_none=True)
    for block in out["content"]:
        block.pop("parsed_output", None)
    return out


def _without_ids(message: dict) -> dict:
    """(A call's id is made each time an answer is parsed.)"""
    blocks = [{k: v for k, v in b.items() if k != "id"} for b in message["content"]]
    return {**{k: v for k, v in message.items() if k != "id"}, "content": blocks}


# ---- the request -> a chat request ---------------------------------------------------------------------


def test_content_blocks_become_the_chat_messages_templates_read():
    req = MessagesRequest.model_validate({
        "max_tokens": 5,
        "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Be kind."}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "weather?"},
                                         {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": "plan", "signature": "s"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": [{"type": "text", "text": "sunny"}]},
                {"type": "text", "text": "thanks"}]},
        ],
    })  # fmt: skip
    messages = [m.model_dump(exclude_none=True) for m in req.chat_request().messages]
    assert messages == [
        {"role": "system", "content": "Be brief.\nBe kind."},
        {"role": "user", "content": [{"type": "text", "text": "weather?"},
                                     {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "plan", "tool_calls": [
            {"id": "t1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "t1"},
        {"role": "user", "content": "thanks"},
    ]  # fmt: skip


def test_the_request_maps_onto_the_chat_request():
    req = MessagesRequest.model_validate({
        "messages": USER, "max_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "stop_sequences": ["##"],
        "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_weather"}, "thinking": {"type": "disabled"},
        "min_p": 0.1, "metadata": {"user_id": "u"},
    })  # fmt: skip
    chat = req.chat_request()
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k, chat.stop, chat.min_p) == (
        7, 0.5, 0.9, 3, ["##"], 0.1)  # fmt: skip
    assert chat.forces_tool_calls and chat.tools[0].function.parameters == {"type": "object"}
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    kept = MessagesRequest.model_validate({"messages": USER, "max_tokens": 1, "thinking": {"type": "enabled"},
                                           "chat_template_kwargs": {"enable_thinking": False}})  # fmt: skip
    assert kept.chat_request().chat_template_kwargs == {"enable_thinking": False}, "the request's own wins"
    # thinking.budget_tokens is the thinking budget (--enable-strict-thinking enforces it); the request's
    # own custom_params.thinking_budget wins.
    budgeted = {"messages": USER, "max_tokens": 9, "thinking": {"type": "enabled", "budget_tokens": 1024}}
    assert MessagesRequest.model_validate(budgeted).chat_request().custom_params == {"thinking_budget": 1024}
    own = {**budgeted, "custom_params": {"thinking_budget": 5, "x": 1}}
    assert MessagesRequest.model_validate(own).chat_request().custom_params == {"thinking_budget": 5, "x": 1}
    off = {**budgeted, "thinking": {"type": "disabled", "budget_tokens": 1024}}
    assert MessagesRequest.model_validate(off).chat_request().custom_params is None
    anyone = MessagesRequest.model_validate({"messages": USER, "max_tokens": 1, "tools": TOOLS,
                                             "tool_choice": {"type": "any"}})  # fmt: skip
    assert anyone.chat_request().tool_choice == "required"


@pytest.mark.parametrize(
    "body, words",
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]},
         "messages[0].content[0].type"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
         "messages[0].content[0].source"),
        ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "server tool"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
        ({"system": [{"type": "image"}]}, "system[0]"),
        # Review: a 500 (a non-object merged), chat's words for Anthropic's fields.
        ({"thinking": {"type": "enabled"}, "chat_template_kwargs": "x"}, "chat_template_kwargs"),
        ({"tools": TOOLS, "tool_choice": {"type": "tool"}}, "tool_choice"),
        ({"stop_sequences": [""]}, "stop_sequences"),
        ({"tools": TOOLS + TOOLS}, "as an earlier tool is"),
    ],
)  # fmt: skip
def test_bad_requests_are_anthropic_400s_naming_the_field(body, words):
    serving = _serving()
    status, reply = _create(serving, **body)
    assert status == 400 and reply["type"] == "error" and reply["error"]["type"] == "invalid_request_error"
    assert words in reply["error"]["message"], reply
    assert serving.tm.prompts == [], "refused before anything was generated"


# ---- the answer -> content blocks, whole and streamed ------------------------------------------------------


@pytest.mark.parametrize(
    "answer, finish, matched, kinds, stop",
    [
        ("Hello there", "stop", 2, ["text"], "end_turn"),
        ("<think>plan</think>Checking.\n" + CALL, "stop", 2, ["thinking", "text", "tool_use"], "tool_use"),
        ("Hi " + CALL + " bye", "stop", 2, ["text", "tool_use"], "tool_use"),
        ("<think>a plan cut short", "length", None, ["thinking"], "max_tokens"),
        ("done", "stop", "##", ["text"], "stop_sequence"),
        ("", "stop", 2, [], "end_turn"),
    ],
)
def test_the_stream_builds_what_the_whole_reply_has(answer, finish, matched, kinds, stop):
    serving = _serving(answer, finish=finish, matched=matched)
    body = {"tools": TOOLS, "stop_sequences": ["##"], "system": "Be brief."}
    status, whole = _create(serving, **body)
    assert status == 200
    Message.model_validate(whole)  # the anthropic package's own model parses it
    assert [b["type"] for b in whole["content"]] == kinds and whole["stop_reason"] == stop
    assert whole["stop_sequence"] == ("##" if stop == "stop_sequence" else None)
    if "tool_use" in kinds:
        assert whole["content"][-1]["input"] == {"city": "Paris"} and whole["content"][-1]["name"] == "get_weather"
    status, events = _create(serving, stream=True, **body)
    assert [e["type"] for e in events][0] == "message_start" and events[-1]["type"] == "message_stop"
    built = _accumulated(events)
    assert _without_ids(built) == _without_ids({k: v for k, v in whole.items() if v is not None})
    usage = whole["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == len(serving.tm.prompts[0])
    assert usage["output_tokens"] == len(answer) and usage["cache_read_input_tokens"] == 3


def test_count_tokens_counts_what_a_message_would_send():
    serving = _serving()
    body = {"messages": USER, "system": "Be brief.", "tools": TOOLS}
    counted = asyncio.run(serving.count_tokens(_request(body, "/v1/messages/count_tokens")))
    assert counted.status_code == 200
    _create(serving, **body)
    assert orjson.loads(counted.body) == {"input_tokens": len(serving.tm.prompts[-1])}
    bad = asyncio.run(serving.count_tokens(_request({"messages": "x"}, "/v1/messages/count_tokens")))
    assert bad.status_code == 400 and orjson.loads(bad.body)["type"] == "error"


def test_a_failure_is_an_anthropic_error_whole_or_mid_stream():
    from sglang.srt.managers.tokenizer_manager import ServerAbortError

    failing = ServerAbortError(503, "The server is shutting down.")
    status, reply = _create(_serving(fail=failing))
    assert status == 503
    assert reply == {"type": "error", "error": {"type": "overloaded_error", "message": "The server is shutting down."}}
    status, events = _create(_serving(fail=failing), stream=True)
    assert events[-1] == {"type": "error", "error": {"type": "overloaded_error", "message": "The server is shutting down."}}
    status, reply = _create(_serving(fail=RequestError("rid 'x' is already running.", "rid")))
    assert status == 400 and reply["error"]["message"] == "rid 'x' is already running."


def test_a_big_integer_is_no_server_error():
    serving = _serving()
    raw = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "metadata": {"n": 100000000000000000000000}}'
    reply = asyncio.run(serving.messages(_request(raw)))
    assert reply.status_code == 200


def test_review_fixes_prefill_is_error_null_stream_and_a_big_integer_in_a_call():
    prefill = MessagesRequest.model_validate(
        {"max_tokens": 4, "stream": None, "messages": USER + [{"role": "assistant", "content": "The answer is ("}]}
    )
    chat = prefill.chat_request()
    assert chat.continue_final_message and not chat.stream, "Anthropic's prefill: the answer goes on from it"
    failed = MessagesRequest.model_validate({"max_tokens": 4, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "t1", "content": "ENOENT", "is_error": True}]}]})  # fmt: skip
    assert failed.chat_request().messages[0].content == "Error: ENOENT"
    big = '<tool_call>\n{"name": "get_weather", "arguments": {"n": 123456789012345678901234567890}}\n</tool_call>'
    status, whole = _create(_serving(big), tools=TOOLS)
    assert status == 200 and whole["content"][0]["input"] == {"n": 1.2345678901234568e29}


def test_a_stream_quiet_through_a_long_call_sends_pings(monkeypatch):
    from sglang.srt.entrypoints import stream_keepalive

    monkeypatch.setattr(stream_keepalive, "KEEPALIVE_SECONDS", 0.0)
    serving = _serving("<think>plan</think>" + CALL)
    _, whole = _create(serving, tools=TOOLS)
    _, events = _create(serving, stream=True, tools=TOOLS)
    assert "ping" in [e["type"] for e in events], "the call's chunks send nothing else"
    assert _without_ids(_accumulated(events)) == _without_ids({k: v for k, v in whole.items() if v is not None})


def test_a_tool_use_input_nested_past_orjsons_limit_is_a_400():
    """Review: json's recursion limit made a 1,000-level input a 500 on both routes."""
    deep = b'{"a":' * 1000 + b"{}" + b"}" * 1000
    body = (b'{"max_tokens": 4, "messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", '
            b'"name": "f", "input": ' + deep + b"}]}]}")  # fmt: skip
    for route in ("messages", "count_tokens"):
        reply = asyncio.run(getattr(_serving(), route)(_request(body)))
        assert reply.status_code == 400 and "messages[0].content[0].input" in orjson.loads(reply.body)["error"]["message"]


def test_disable_parallel_tool_use_gives_one_call():
    for stream in (False, True):
        _, out = _create(_serving(CALL + "\n" + CALL), stream=stream, tools=TOOLS,
                         tool_choice={"type": "auto", "disable_parallel_tool_use": True})  # fmt: skip
        out = _accumulated(out) if stream else out
        assert [b["type"] for b in out["content"]] == ["tool_use"]


def test_a_prefill_is_text_only_and_not_with_an_always_thinking_parser():
    """Review: a final assistant message's tool_use or thinking were dropped from a continued prompt; with
    deepseek-r1's parser the continuation came back as thinking."""
    for blocks in ([{"type": "tool_use", "id": "t", "name": "get_weather", "input": {}}],
                   [{"type": "thinking", "thinking": "plan", "signature": "s"}, {"type": "text", "text": "So"}]):
        status, reply = _create(_serving(), tools=TOOLS, messages=USER + [{"role": "assistant", "content": blocks}])
        assert status == 400 and "messages[1]" in reply["error"]["message"]
    r1 = AnthropicServing(OpenAIServingChat(FakeChatTokenizerManager(" is sunny."), "m", reasoning_parser="deepseek-r1"))
    status, reply = _create(r1, messages=USER + [{"role": "assistant", "content": "The weather"}])
    assert status == 400 and "always thinks first" in reply["error"]["message"]
    status, reply = _create(_serving(" is sunny."), messages=USER + [{"role": "assistant", "content": "The weather"}])
    assert status == 200 and reply["content"] == [{"type": "text", "text": " is sunny."}]
