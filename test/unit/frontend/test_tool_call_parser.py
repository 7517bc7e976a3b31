"""`--tool-call-parser qwen25` and `qwen3_coder`: a chat answer's `<tool_call>{json}</tool_call>` or
`<tool_call><function=...><parameter=...>` blocks into OpenAI tool calls (XML values typed by the tool's
schema), whole and streamed (any cutting gives what the whole answer gives); the tools reach the chat
template, with an earlier turn's calls and the tools' answers."""

from __future__ import annotations

import asyncio
import json
import re
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_base import parse_model
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.function_call.function_call_parser import ToolCallParser
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
        # The whitespace after a call separates calls: dropped; the text before them stays as it is.
        (
            "Let me look.\n" + CALL + "\n" + CALL + "\n",
            ("Let me look.\n", [("get_weather", {"city": "Paris"})] * 2),
        ),
        (CALL + "\n Done.", ("Done.", [("get_weather", {"city": "Paris"})])),
        ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', ("", [("f", {"x": 1})])),
        ('<tool_call>{"name": "f"}</tool_call>', ("", [("f", {})])),
        ("It is sunny.", ("It is sunny.", [])),
        # Not a call, or cut off: the text stays as generated.
        ("<tool_call>not json</tool_call>", ("<tool_call>not json</tool_call>", [])),
        ('<tool_call>{"arguments": {}}</tool_call>', ('<tool_call>{"arguments": {}}</tool_call>', [])),
        ('a <tool_call>{"name": "f"', ('a <tool_call>{"name": "f"', [])),
        # NaN is not JSON; nesting past Python's stack is not a call either (no crash).
        (
            '<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>',
            ('<tool_call>{"name": "f", "arguments": {"x": NaN}}</tool_call>', []),
        ),
        ("<tool_call>" + "[" * 5000 + "</tool_call>", ("<tool_call>" + "[" * 5000 + "</tool_call>", [])),
        # 1e400 parses as inf, which JSON cannot carry in `arguments`: not a call.
        (
            '<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>',
            ('<tool_call>{"name": "f", "arguments": {"x": 1e400}}</tool_call>', []),
        ),
        ("a <tool_ca", ("a <tool_ca", [])),
    ],
)
def test_whole_answers(text, want):
    assert calls_of(text) == want


def test_a_name_the_request_has_no_tool_for_stays_text():
    block = '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>'
    content, calls = ToolCallParser({"get_weather": None}).parse(block + CALL)
    assert content == block and [c["function"]["name"] for c in calls] == ["get_weather"]


def test_string_arguments_pass_through_and_ids_are_distinct():
    content, calls = ToolCallParser().parse(
        CALL + '<tool_call>{"name": "g", "arguments": "{\\"a\\": 1}"}</tool_call>'
    )
    assert calls[1]["function"]["arguments"] == '{"a": 1}' and [c["index"] for c in calls] == [0, 1]
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["id"].startswith("call_")


pieces = st.lists(
    st.sampled_from([CALL, "<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "f"}', "x", "\n"])
)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(parts=pieces, cuts=st.lists(st.integers(0, 400)))
def test_any_cutting_streams_what_the_whole_answer_gives(parts, cuts):
    _check_streaming(ToolCallParser, "".join(parts), cuts)


def _check_streaming(make_parser, text: str, cuts: list[int]) -> list[dict]:
    """The pieces of `text` cut at `cuts`, fed one by one, give what the whole text gives; the calls."""
    whole_content, whole_calls = make_parser().parse(text)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    parser, content, calls = make_parser(), "", []
    for a, b in zip(bounds, bounds[1:], strict=False):
        c, new = parser.feed(text[a:b])
        content, calls = content + c, calls + new
    content += parser.finish()
    strip = [(c["index"], c["function"]) for c in calls]
    assert (content, strip) == (whole_content, [(c["index"], c["function"]) for c in whole_calls])
    return calls


# ---- qwen3_coder: XML calls ---------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "metric": {"type": "boolean"},
        "temp": {"type": "number"},
        "opts": {"type": "object"},
        "tags": {"type": ["array", "null"]},
    },
}
XML = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"


def xml_calls_of(text: str, tools=None) -> tuple[str, list[tuple[str, dict]]]:
    tools = {"get_weather": SCHEMA, "f": None} if tools is None else tools
    content, calls = ToolCallParser(tools, "qwen3_coder").parse(text)
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _xml(*params: tuple[str, str], name: str = "get_weather") -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


@pytest.mark.parametrize(
    "params, want",
    [
        # The template's layout: one newline each side of a value is layout, not value.
        ([("city", "Paris"), ("days", "3")], {"city": "Paris", "days": 3}),
        ([("city", "two\nlines "), ("metric", "True")], {"city": "two\nlines ", "metric": True}),
        ([("temp", "21.5"), ("days", " 7 ")], {"temp": 21.5, "days": 7}),
        (
            [("temp", "3"), ("opts", '{"unit": "C"}'), ("tags", '["a"]')],
            {"temp": 3, "opts": {"unit": "C"}, "tags": ["a"]},
        ),
        ([("tags", "null"), ("city", "null")], {"tags": None, "city": None}),
        # Text that is not the schema's type stays the string (as upstream); so does an unknown key.
        (
            [("days", "three"), ("metric", "yes"), ("opts", "{bad"), ("temp", "1e999")],
            {"days": "three", "metric": "yes", "opts": "{bad", "temp": "1e999"},
        ),
        # JSON for an object or array type is taken as either container (as upstream).
        (
            [("temp", "NaN"), ("opts", "[1]"), ("unknown", "42")],
            {"temp": "NaN", "opts": [1], "unknown": "42"},
        ),
        ([("opts", '{"x": 1e400}')], {"opts": '{"x": 1e400}'}),
        ([], {}),
    ],
)
def test_xml_values_take_the_schemas_types(params, want):
    assert xml_calls_of(_xml(*params)) == ("", [("get_weather", want)])


@pytest.mark.parametrize(
    "text, want",
    [
        ("Sure.\n" + XML + "\n" + XML, ("Sure.\n", [("get_weather", {"city": "Paris"})] * 2)),
        # Several functions in one block; closing tags left out end where the next tag (or block) starts.
        (
            "<tool_call><function=f><parameter=a>1</parameter></function><function=f></function></tool_call>",
            ("", [("f", {"a": "1"}), ("f", {})]),
        ),
        (
            "<tool_call>\n<function=f>\n<parameter=a>\nx\n<parameter=b>\ny\n</tool_call>",
            ("", [("f", {"a": "x", "b": "y"})]),
        ),
        # Not a call: stays text as generated.
        (
            "<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>",
            ("<tool_call>\n<function=rm_rf>\n</function>\n</tool_call>", []),
        ),
        (
            "<tool_call>prose <function=f></function></tool_call>",
            ("<tool_call>prose <function=f></function></tool_call>", []),
        ),
        (
            "<tool_call><function=f>stray<parameter=a>1</parameter></function></tool_call>",
            ("<tool_call><function=f>stray<parameter=a>1</parameter></function></tool_call>", []),
        ),
        ("<tool_call></tool_call>", ("<tool_call></tool_call>", [])),
        ("<tool_call><function=f>", ("<tool_call><function=f>", [])),
        # A JSON block is not this format's call.
        (CALL, (CALL, [])),
    ],
)
def test_xml_whole_answers(text, want):
    assert xml_calls_of(text) == want


xml_pieces = st.lists(st.sampled_from(
    [XML, "<tool_call>", "</tool_call>", "<function=f>", "</function>", "<parameter=a>", "</parameter>", "<tool", "1", "\n"]
))  # fmt: skip


@settings(max_examples=300, deadline=None, derandomize=True)
@given(parts=xml_pieces, cuts=st.lists(st.integers(0, 400)))
def test_xml_any_cutting_streams_what_the_whole_answer_gives(parts, cuts):
    tools = {"get_weather": SCHEMA, "f": {"properties": {"a": {"type": "integer"}}}}
    calls = _check_streaming(lambda: ToolCallParser(tools, "qwen3_coder"), "".join(parts), cuts)
    for call in calls:
        json.loads(call["function"]["arguments"])  # always valid JSON


# ---- the chat route ---------------------------------------------------------------------------------


class _Template:
    """Records what the chat template gets."""

    chat_template = "tools-aware"

    def __init__(self):
        self.seen: list[dict] = []

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kwargs):
        self.seen.append({"messages": messages, **kwargs})
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + (
            "<assistant>" if add_generation_prompt else ""
        )


def _serving(parser: str | None = "qwen25") -> OpenAIServingChat:
    async def encode(text, param, add_special_tokens=True, truncate=False):
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
    text = "Checking.\n" + CALL + "\n" + CALL
    choice = serving.make_choice(req, 0, {"text": text, "meta_info": _meta(True)})
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    call, again = choice.message.tool_calls
    assert (
        call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'} and "index" not in call
    )
    assert call["id"] != again["id"]
    progress: dict = {}
    chunks = []
    for k, piece in enumerate([text[:15], text[15:40], text[40:], ""]):
        chunks += serving.stream_choices(req, 0, piece, _meta(k == 3), progress)
    streamed = [c for ch in chunks for c in ch.delta.tool_calls or []]
    assert [c["function"] for c in streamed] == [call["function"]] * 2 and [c["index"] for c in streamed] == [
        0,
        1,
    ]
    assert "".join(ch.delta.content or "" for ch in chunks) == choice.message.content, "streamed as whole"
    assert chunks[-1].finish_reason == "tool_calls"


def test_a_call_cut_by_the_length_limit_keeps_length_and_reasoning_comes_first():
    serving = OpenAIServingChat(_serving().tm, "m", reasoning_parser="deepseek-r1", tool_call_parser="qwen25")
    req = _request(serving)
    out = {"text": "hm" + "</think>" + CALL, "meta_info": {"finish_reason": {"type": "length", "length": 9}}}
    choice = serving.make_choice(req, 0, out)
    assert choice.message.reasoning_content == "hm" and len(choice.message.tool_calls) == 1
    assert choice.finish_reason == "length", "only a stop becomes tool_calls"


def test_the_chat_route_types_qwen3_coder_calls_by_the_requests_schema():
    serving = _serving("qwen3_coder")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    req = _request(serving, tools=tools)
    text = "Checking.\n" + _xml(("city", "Paris"), ("days", "2"))
    choice = serving.make_choice(req, 0, {"text": text, "meta_info": _meta(True)})
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking.\n"
    (call,) = choice.message.tool_calls
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}


@pytest.mark.parametrize("flag", ["tool_call_parser", "reasoning_parser"])
def test_an_unknown_parser_name_is_refused(flag):
    """Also where ServerArgs is built in code (not through argparse's choices): at startup, by name."""
    from sglang.srt.server_args import ServerArgs, ServerArgsError

    with pytest.raises(ServerArgsError, match=f"--{flag.replace('_', '-')} must be one of"):
        ServerArgs(**{flag: "llama3"})


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
    # Arguments as a mapping (Qwen2.5's template tojson-s them: a string would be quoted).
    assert messages[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


TWO_TOOLS = TOOLS + [{"type": "function", "function": {"name": "get_time"}}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


def test_a_forced_call_is_a_json_schema_of_calls():
    """Upstream's constraint: "required" is an array of at least one call of any tool, a named function
    exactly one call of it (a tool without parameters takes an empty object)."""
    for choice, want in [("required", TWO_TOOLS), (NAMED, TWO_TOOLS[1:])]:
        params = _request(_serving(None), tools=TWO_TOOLS, tool_choice=choice).sampling_params()
        schema = json.loads(params["json_schema"])
        items = schema["items"]["anyOf"] if choice == "required" else [schema["items"]]
        assert schema["type"] == "array" and schema["minItems"] == 1 and schema.get("maxItems") == (
            None if choice == "required" else 1
        )
        names = [i["properties"]["name"]["enum"] for i in items]
        assert names == [[t["function"]["name"]] for t in want]
        assert items[-1]["properties"]["parameters"] == (
            {"type": "object", "properties": {}} if want[-1] is TWO_TOOLS[1] else {"type": "object"}
        )


@pytest.mark.parametrize(
    "body, words",
    [
        ({"tool_choice": "required", "tools": None}, "has no tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "'nope', which is not one"),
        ({"tool_choice": {"type": "function", "function": "get_weather"}}, "a named tool_choice is"),
        ({"tool_choice": "required", "regex": "a"}, "together with regex"),
    ],
)
def test_a_forced_call_that_cannot_be_made_is_a_400(body, words):
    with pytest.raises(RequestError) as e:
        parse_model(ChatCompletionRequest, orjson.dumps(
            {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, **body}
        ))  # fmt: skip
    assert e.value.param == "tool_choice" and words in e.value.message, e.value.message


@pytest.mark.parametrize("parser", ["qwen25", None])
def test_a_forced_answer_comes_back_as_its_calls_whole_and_streamed(parser):
    """With or without --tool-call-parser (upstream reads the array itself); a reasoning parser does not
    take the answer for reasoning; an answer cut off by max_tokens stays content, with `length`."""
    serving = OpenAIServingChat(_serving().tm, "m", reasoning_parser="deepseek-r1", tool_call_parser=parser)
    req = _request(serving, tools=TWO_TOOLS, tool_choice="required")
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
    text += '{"name": "get_time", "parameters": {}}]'
    choice = serving.make_choice(req, 0, {"text": text, "meta_info": _meta(True)})
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert [c["function"] for c in choice.message.tool_calls] == [
        {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"name": "get_time", "arguments": "{}"},
    ]
    assert all("index" not in c for c in choice.message.tool_calls)
    progress: dict = {}
    chunks = []
    for k, piece in enumerate([text[:15], text[15:60], text[60:], ""]):
        chunks += serving.stream_choices(req, 0, piece, _meta(k == 3), progress)
    streamed = [c for ch in chunks for c in ch.delta.tool_calls or []]
    assert [c["function"] for c in streamed] == [c["function"] for c in choice.message.tool_calls]
    assert [c["index"] for c in streamed] == [0, 1] and not any(ch.delta.content for ch in chunks)
    assert chunks[-1].finish_reason == "tool_calls"
    cut = {"text": text[:30], "meta_info": {"finish_reason": {"type": "length", "length": 9}}}
    choice = serving.make_choice(req, 0, cut)
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content == text[:30]


def test_parallel_tool_calls_false_gives_at_most_one_call_whole_streamed_and_forced():
    serving = _serving()
    req = _request(serving, parallel_tool_calls=False)
    text = "Checking.\n" + CALL + "\n" + CALL
    choice = serving.make_choice(req, 0, {"text": text, "meta_info": _meta(True)})
    assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "tool_calls"
    progress: dict = {}
    chunks = []
    for k, piece in enumerate([text[:15], text[15:40], text[40:80], text[80:], ""]):
        chunks += serving.stream_choices(req, 0, piece, _meta(k == 4), progress)
    assert len([c for ch in chunks for c in ch.delta.tool_calls or []]) == 1
    forced = _request(serving, parallel_tool_calls=False, tool_choice="required")
    assert json.loads(forced.sampling_params()["json_schema"])["maxItems"] == 1
    assert "maxItems" not in json.loads(_request(serving, tool_choice="required").sampling_params()["json_schema"])


def test_a_chat_stream_quiet_through_a_long_call_sends_keepalive_comments(monkeypatch):
    """The call is sent when its block closes: the chunks before say nothing, so the stream sends SSE
    comments (which clients skip) where it was quiet too long, and the same chunks otherwise."""
    from sglang.srt.entrypoints import stream_keepalive
    from sglang.srt.entrypoints.openai import serving_base
    from sglang.test.fake_chat import FakeChatTokenizerManager

    async def stream() -> list[bytes]:
        serving = OpenAIServingChat(FakeChatTokenizerManager("Hi " + CALL), "m", tool_call_parser="qwen25")
        req = parse_model(ChatCompletionRequest, orjson.dumps({"messages": [{"role": "user", "content": "x"}],
                                                                "tools": TOOLS, "stream": True}))  # fmt: skip
        obj = await serving.to_generate_input(req)
        first, gen = await serving_base.start_generation(serving.tm, obj, None)
        return [chunk async for chunk in serving.stream_events(req, obj, first, gen)]

    plain = asyncio.run(stream())
    monkeypatch.setattr(stream_keepalive, "KEEPALIVE_SECONDS", 0.0)
    kept = asyncio.run(stream())
    assert stream_keepalive.SSE_COMMENT not in plain and stream_keepalive.SSE_COMMENT in kept
    without = [c for c in kept if c != stream_keepalive.SSE_COMMENT]

    def choices(chunks: list[bytes]) -> list:  # (a call's id is made each time)
        return [json.loads(re.sub(rb'"id":"call_\w+"', b'"id":""', c[6:]))["choices"] for c in chunks]

    assert choices(without) == choices(plain)
