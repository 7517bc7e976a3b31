"""`--tool-call-parser qwen25`: a chat answer's `<tool_call>{json}</tool_call>` blocks into OpenAI tool
calls, whole and streamed (any cutting gives what the whole answer gives); the tools reach the chat
template, with an earlier turn's calls and the tools' answers."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_base import parse_model
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.tool_call_parser import ToolCallParser
from sglang.srt.managers.request_validation import RequestError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def calls_of(text: str) -> tuple[str, list[tuple[str, dict]]]:
    content, calls = ToolCallParser().parse(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


@pytest.mark.parametrize(
    "text, want",
    [
        (CALL, ("", [("get_weather", {"city": "Paris"})])),
        ("Let me look.\n" + CALL + "\n" + CALL, ("Let me look.\n\n", [("get_weather", {"city": "Paris"})] * 2)),
        ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', ("", [("f", {"x": 1})])),
        ('<tool_call>{"name": "f"}</tool_call>', ("", [("f", {})])),
        ("It is sunny.", ("It is sunny.", [])),
        # Not a call, or cut off: the text stays as generated.
        ("<tool_call>not json</tool_call>", ("<tool_call>not json</tool_call>", [])),
        ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),
        ('a <tool_call>{"name": "f"', ('a <tool_call>{"name": "f"', [])),
        ("a <tool_ca", ("a <tool_ca", [])),
    ],
)
def test_whole_answers(text, want):
    assert calls_of(text) == want


def test_string_arguments_pass_through_and_ids_are_distinct():
    content, calls = ToolCallParser().parse(CALL + '<tool_call>{"name": "g", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert calls[1]["function"]["arguments"] == '{"a": 1}' and [c["index"] for c in calls] == [0, 1]
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("call_")


pieces = st.lists(st.sampled_from([CALL, "<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "f"}', "x", "\n"]))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(parts=pieces, cuts=st.lists(st.integers(0, 400)))
def test_any_cutting_streams_what_the_whole_answer_gives(parts, cuts):
    text = "".join(parts)
    whole_content, whole_calls = ToolCallParser().parse(text)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    parser, content, calls = ToolCallParser(), "", []
    for a, b in zip(bounds, bounds[1:], strict=False):
        c, new = parser.feed(text[a:b])
        content, calls = content + c, calls + new
    content += parser.finish()
    strip = [(c["index"], c["function"]) for c in calls]
    assert (content, strip) == (whole_content, [(c["index"], c["function"]) for c in whole_calls])


# ---- the chat route ---------------------------------------------------------------------------------


class _Template:
    """Records what the chat template gets."""

    chat_template = "tools-aware"

    def __init__(self):
        self.seen: list[dict] = []

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        self.seen.append({"messages": messages, **kwargs})
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


def _serving(parser: str | None = "qwen25") -> OpenAIServingChat:
    async def encode(text, param, add_special_tokens=True):
        return [ord(c) % 50 for c in text]

    tm = SimpleNamespace(tokenizer=_Template(), encode=encode, limits=SimpleNamespace(context_len=4096))
    return OpenAIServingChat(tm, "m", tool_call_parser=parser)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _request(serving: OpenAIServingChat, **body) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "weather?"}], "tools": TOOLS, **body}
    req = parse_model(ChatCompletionRequest, orjson.dumps(body))
    asyncio.run(serving.to_generate_input(req))
    return req


def _meta(finished: bool) -> dict:
    return {"finish_reason": {"type": "stop", "matched": 2} if finished else None}


def test_the_chat_route_returns_parsed_calls_whole_and_streamed():
    serving = _serving()
    req = _request(serving)
    assert serving.tm.tokenizer.seen[-1]["tools"] == TOOLS, "the tools reach the template"
    choice = serving.make_choice(req, 0, {"text": "Checking.\n" + CALL, "meta_info": _meta(True)})
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    (call,) = choice.message.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and "index" not in call
    progress: dict = {}
    chunks = []
    text = "Checking.\n" + CALL
    for k, piece in enumerate([text[:15], text[15:40], text[40:], ""]):
        chunks += serving.stream_choices(req, 0, piece, _meta(k == 3), progress)
    streamed = [c for ch in chunks for c in ch.delta.tool_calls or []]
    assert [c["function"] for c in streamed] == [call["function"]] and streamed[0]["index"] == 0
    assert "".join(ch.delta.content or "" for ch in chunks) == "Checking.\n"
    assert chunks[-1].finish_reason == "tool_calls"


def test_tool_choice_none_and_no_parser_leave_the_text():
    serving = _serving()
    req = _request(serving, tool_choice="none")
    assert "tools" not in serving.tm.tokenizer.seen[-1], "as upstream: the template does not show them"
    choice = serving.make_choice(req, 0, {"text": CALL, "meta_info": _meta(True)})
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (CALL, None, "stop")
    plain = _serving(None)
    choice = plain.make_choice(_request(plain), 0, {"text": CALL, "meta_info": _meta(True)})
    assert choice.message.content == CALL and plain.tm.tokenizer.seen[-1]["tools"] == TOOLS


def test_a_conversation_with_calls_and_answers_reaches_the_template():
    serving = _serving()
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    _request(serving, messages=history)
    messages = serving.tm.tokenizer.seen[-1]["messages"]
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forcing_a_call_needs_constrained_decoding(choice):
    with pytest.raises(RequestError) as e:
        parse_model(ChatCompletionRequest, orjson.dumps(
            {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": choice}
        ))  # fmt: skip
    assert e.value.param == "tool_choice" and "constrained decoding" in e.value.message
