"""POST /v1/responses (OpenAI's Responses API) over the chat serving, with a fake template and a fake
generation: input items to chat messages, the request to a chat request (errors in this API's names), the
answer to output items and to stream events that the `openai` package's own models parse, a stream that
builds what the whole reply has, the store (chaining = replaying the conversation, its byte bound, the
background lifecycle). The real server: test/registered/openai_server/test_openai_api.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from openai.types.responses import Response as OpenAIResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from starlette.exceptions import HTTPException

from sglang.srt.entrypoints.openai.response_store import ResponseStore, StoredResponse
from sglang.srt.entrypoints.openai.responses_items import input_messages
from sglang.srt.entrypoints.openai.responses_protocol import ResponsesRequest
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.entrypoints.openai.serving_responses import OpenAIServingResponses
from sglang.srt.managers.request_validation import RequestError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_chat import FakeChatTokenizerManager

register_cpu_ci(est_time=4, suite="per-commit-cpu")

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]
PATCH_TOOL = {"type": "custom", "name": "apply_patch", "description": "Edit files.",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}  # fmt: skip
PATCH = '<tool_call>\n{"name": "apply_patch", "arguments": {"input": "*** Begin Patch\\n+x"}}\n</tool_call>'
EVENTS = TypeAdapter(ResponseStreamEvent)


def _serving(answer: str = "Hello there", store: bool = True, **tm_kw) -> OpenAIServingResponses:
    chat = OpenAIServingChat(FakeChatTokenizerManager(answer, **tm_kw), "m", reasoning_parser="qwen3", tool_call_parser="qwen25")
    return OpenAIServingResponses(chat, ResponseStore(1 << 20) if store else None)


def _request(body: dict | bytes) -> SimpleNamespace:
    async def read():
        return body if isinstance(body, bytes) else orjson.dumps(body)

    return SimpleNamespace(body=read, url=SimpleNamespace(path="/v1/responses"), is_disconnected=None)


def _create(serving: OpenAIServingResponses, **body):
    return asyncio.run(_create_async(serving, **body))


async def _create_async(serving, **body):
    reply = await serving.create(_request({"input": "weather?", **body}))
    if not body.get("stream"):
        return orjson.loads(reply.body)
    return [_event(chunk) async for chunk in reply.body_iterator if not chunk.startswith(b":")]


def _event(chunk: bytes) -> dict:
    head, data = chunk.decode().split("\n", 1)
    event = json.loads(data.removeprefix("data: "))
    assert head == f"event: {event['type']}"
    EVENTS.validate_python(event)  # the openai package's own event models parse it
    return event


def _without_ids(x):
    if isinstance(x, dict):
        return {k: _without_ids(v) for k, v in x.items() if k not in ("id", "call_id", "completed_at", "created_at")}
    if isinstance(x, list):
        return [_without_ids(v) for v in x]
    return x


# ---- input items -> chat messages ------------------------------------------------------------------


def test_input_items_become_the_chat_messages_templates_read():
    items = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "weather "}, {"type": "input_text", "text": "?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "plan"}]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"role": "assistant", "content": "Sunny and rain."},
        {"role": "user", "content": [{"type": "input_image", "image_url": "data:image/png;base64,AA=="}]},
    ]
    calls = [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}},
    ]
    assert input_messages(items) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "weather ?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "plan", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "content": "Sunny and rain."},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]},
    ]
    assert input_messages("hi") == [{"role": "user", "content": "hi"}]
    image = {"type": "input_image", "image_url": "data:image/png;base64,AA=="}
    (tool,) = input_messages([{"type": "function_call_output", "call_id": "c", "output": [image]}])
    assert tool["content"] == [{"type": "image_url", "image_url": {"url": image["image_url"]}}], "kept (review)"


@pytest.mark.parametrize(
    "item, param",
    [
        ({"type": "web_search_call", "id": "ws"}, "input[1].type"),
        ({"role": "tool", "content": "x"}, "input[1].role"),
        ({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}, "input[1].content[0]"),
        ({"type": "function_call", "name": "f"}, "input[1]"),
        ({"type": "function_call_output", "call_id": "c"}, "input[1]"),
        ({"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}, "input[1].content[0]"),
        ({"type": "reasoning", "summary": [{"type": "summary_text", "text": None}]}, "input[1].summary[0]"),
        ({"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}, "input[1].output[0]"),
    ],
)
def test_a_bad_input_item_is_a_400_naming_it(item, param):
    with pytest.raises(RequestError) as e:
        input_messages([{"role": "user", "content": "hi"}, item])
    assert e.value.param == param and param in e.value.message


# ---- the request -> a chat request -------------------------------------------------------------------


def test_the_request_maps_onto_the_chat_request():
    req = ResponsesRequest.model_validate({
        "input": "x", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "tools": TOOLS,
        "tool_choice": {"type": "function", "name": "get_weather"}, "top_k": 3, "seed": 5, "unknown": 1,
        "include": ["message.output_text.logprobs"], "top_logprobs": 2,
    })  # fmt: skip
    chat = req.chat_request([{"role": "user", "content": "x"}])
    assert (chat.max_tokens, chat.temperature, chat.top_p, chat.top_k, chat.seed) == (7, 0.5, 0.9, 3, 5)
    assert chat.tools[0].function.name == "get_weather" and chat.forces_tool_calls
    assert chat.logprobs and chat.top_logprobs == 2
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                                            "schema": schema}}})  # fmt: skip
    assert fmt.chat_request([{"role": "user", "content": "x"}]).sampling_params()["json_schema"] == json.dumps(schema)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": {"type": "function", "name": "nope"}, "tools": TOOLS}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "function"}]}, "tools[0].name"),
        ({"tools": TOOLS + [dict(PATCH_TOOL, name="get_weather")]}, "tools[1].name"),
        ({"text": {"format": {"type": "json_schema", "name": "a"}}}, "text.format"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"include": ["everything"]}, "include"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"input": []}, "input"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"background": True, "stream": True}, "stream"),
        ({"background": True, "store": False}, "store"),
        ({"stop": ""}, "stop"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ],
)
def test_bad_requests_are_a_400_naming_the_field_in_this_apis_words(body, param):
    serving = _serving()
    with pytest.raises(RequestError) as e:
        _create(serving, **body)
    assert e.value.param == param, e.value.message
    assert serving.tm.prompts == [], "refused before anything was generated"


def test_without_the_store_chaining_and_background_are_refused_and_nothing_is_kept():
    serving = _serving(store=False)
    for field, value in (("previous_response_id", "resp_x"), ("background", True)):
        with pytest.raises(RequestError) as e:
            _create(serving, **{field: value})
        assert e.value.param == field and "--enable-response-store" in e.value.message
    reply = _create(serving)
    assert reply["store"] is False and reply["status"] == "completed"
    with pytest.raises(HTTPException) as e:
        serving.retrieve(reply["id"])
    assert e.value.status_code == 404 and "--enable-response-store" in e.value.detail


# ---- the answer -> output items, whole and streamed ---------------------------------------------------


@pytest.mark.parametrize(
    "answer, finish, kinds, status",
    [
        ("Hello there", "stop", ["message"], "completed"),
        ("<think>plan</think>Checking.\n" + CALL, "stop", ["reasoning", "message", "function_call"], "completed"),
        ("<think>plan</think>" + CALL + "\n" + CALL, "stop", ["reasoning", "function_call", "function_call"], "completed"),
        ("long plan with no end", "length", ["message"], "incomplete"),
        ("<think>a plan cut short", "length", ["reasoning"], "incomplete"),
        ("<think>edit</think>" + PATCH + "\n" + CALL, "stop", ["reasoning", "custom_tool_call", "function_call"],
         "completed"),
        # Text after a call joins the one message, before the calls, in both (review: the stream opened a
        # second message after the call).
        ("Hi " + CALL + " bye", "stop", ["message", "function_call"], "completed"),
        # Cut while answering: the message is incomplete, the reasoning before it completed (review: the
        # whole reply marked every item incomplete).
        ("<think>plan</think>partial answ", "length", ["reasoning", "message"], "incomplete"),
        ("", "stop", ["message"], "completed"),
    ],
)
def test_the_stream_builds_what_the_whole_reply_has(answer, finish, kinds, status):
    serving = _serving(answer, finish=finish)
    body = {"tools": TOOLS + [PATCH_TOOL], "include": ["message.output_text.logprobs"], "instructions": "Be brief."}
    whole = _create(serving, **body)
    OpenAIResponse.model_validate(whole)  # the openai package's own model parses it
    assert [item["type"] for item in whole["output"]] == kinds and whole["status"] == status
    if status == "incomplete":
        assert whole["incomplete_details"] == {"reason": "max_output_tokens"}
    events = _create(serving, stream=True, **body)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    final = events[-1]["response"]
    assert events[-1]["type"] == ("response.incomplete" if status == "incomplete" else "response.completed")
    assert _without_ids(final) == _without_ids(whole)
    # The items the deltas build are the items the last event has.
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    reasoning = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    messages = [i for i in final["output"] if i["type"] == "message"]
    assert text == "".join(m["content"][0]["text"] for m in messages)
    assert reasoning == "".join(i["content"][0]["text"] for i in final["output"] if i["type"] == "reasoning")
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == final["output"]
    added = [e["output_index"] for e in events if e["type"] == "response.output_item.added"]
    assert added == list(range(len(final["output"])))
    statuses = [i["status"] for i in final["output"]]
    cut = "message" if "message" in kinds else "reasoning"
    assert statuses == ["incomplete" if status == "incomplete" and k == cut else "completed" for k in kinds]
    usage = final["usage"]
    assert usage["output_tokens"] == len(answer) and usage["input_tokens_details"]["cached_tokens"] == 3
    assert usage["output_tokens_details"]["reasoning_tokens"] == len(reasoning)


def test_calls_come_back_as_function_call_items_with_their_call_ids():
    whole = _create(_serving("<think>plan</think>" + CALL), tools=TOOLS)
    (call,) = [i for i in whole["output"] if i["type"] == "function_call"]
    assert (call["name"], json.loads(call["arguments"])) == ("get_weather", {"city": "Paris"})
    assert call["call_id"].startswith("call") and call["id"].startswith("fc_")


def test_logprobs_only_when_asked_and_only_the_messages_own_tokens():
    plain = _create(_serving())
    assert "logprobs" not in plain["output"][0]["content"][0]
    plain_stream = _create(_serving(), stream=True)
    assert "logprobs" not in plain_stream[-1]["response"]["output"][0]["content"][0]
    asked = _create(_serving(), include=["message.output_text.logprobs"])
    entries = asked["output"][0]["content"][0]["logprobs"]
    assert "".join(e["token"] for e in entries) == "Hello there"
    # Reasoning and call tokens are not the message's (review: they were).
    answer = "<think>plan</think>Hi " + CALL
    for stream in (False, True):
        out = _create(_serving(answer), stream=stream, tools=TOOLS, include=["message.output_text.logprobs"])
        out = out[-1]["response"] if stream else out
        (message,) = [i for i in out["output"] if i["type"] == "message"]
        assert "".join(e["token"] for e in message["content"][0]["logprobs"]) == "Hi ", stream


# ---- the store --------------------------------------------------------------------------------------


def test_a_chained_turn_renders_what_replaying_the_conversation_renders():
    serving = _serving("<think>plan</think>" + CALL)
    first = _create(serving, tools=TOOLS, instructions="OLD")
    result = {"type": "function_call_output", "call_id": first["output"][-1]["call_id"], "output": "sunny"}
    _create(serving, tools=TOOLS, previous_response_id=first["id"], input=[result], instructions="NEW")
    replay = [{"role": "user", "content": "weather?"}, *first["output"], result]
    _create(serving, tools=TOOLS, input=replay, instructions="NEW")
    chained, replayed = serving.tm.prompts[1], serving.tm.prompts[2]
    assert chained == replayed
    seen = serving.tm.tokenizer.seen[1]["messages"]
    assert seen[0] == {"role": "system", "content": "NEW"}, "instructions are not carried over"
    assert seen[2]["reasoning_content"] == "plan" and seen[2]["tool_calls"], "the earlier turn's reasoning and call"
    assert "OLD" not in str(seen)


@pytest.mark.parametrize(
    "first_input, next_input",
    [
        # (A) the earlier input ends with an assistant message; (B) with a reasoning item; (D) the next
        # input starts with a call (review: each rendered differently chained and replayed).
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure,"}], [{"role": "user", "content": "go"}]),
        ([{"role": "user", "content": "hi"}, {"type": "reasoning", "summary": [], "content": [
            {"type": "reasoning_text", "text": "earlier"}]}], [{"role": "user", "content": "go"}]),
        ([{"role": "user", "content": "hi"}], [{"type": "function_call", "call_id": "c9", "name": "get_weather",
                                                 "arguments": "{}"}, {"type": "function_call_output",
                                                 "call_id": "c9", "output": "ok"}]),
    ],
)  # fmt: skip
def test_chaining_renders_what_replaying_renders_at_the_turns_edges(first_input, next_input):
    for answer in ("Hello", "<think>plan</think>" + CALL):
        serving = _serving(answer)
        first = _create(serving, tools=TOOLS, input=first_input)
        _create(serving, tools=TOOLS, previous_response_id=first["id"], input=next_input)
        _create(serving, tools=TOOLS, input=first_input + first["output"] + next_input, store=False)
        assert serving.tm.prompts[1] == serving.tm.prompts[2], answer


def test_stored_responses_are_retrieved_listed_and_deleted():
    serving = _serving()
    reply = _create(serving, input=[{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    assert orjson.loads(serving.retrieve(reply["id"]).body) == reply
    listed = orjson.loads(serving.input_items(reply["id"], order="asc").body)
    assert [i["content"][0]["text"] for i in listed["data"]] == ["a", "b"] and not listed["has_more"]
    page = orjson.loads(serving.input_items(reply["id"], limit="1").body)
    assert [i["content"][0]["text"] for i in page["data"]] == ["b"] and page["has_more"]
    for bad in ({"limit": "abc"}, {"limit": "0"}, {"order": "up"}, {"after": "msg_nope"}):
        with pytest.raises(RequestError) as e:
            serving.input_items(reply["id"], **bad)
        assert e.value.param == next(iter(bad))
    after = orjson.loads(serving.input_items(reply["id"], after=page["last_id"]).body)
    assert [i["content"][0]["text"] for i in after["data"]] == ["a"]
    asyncio.run(serving.delete(reply["id"]))
    with pytest.raises(HTTPException):
        serving.retrieve(reply["id"])
    not_stored = _create(serving, store=False)
    assert not_stored["store"] is False
    with pytest.raises(HTTPException):
        serving.retrieve(not_stored["id"])


def test_the_store_keeps_its_byte_bound_dropping_the_least_recently_used_finished_response():
    store = ResponseStore(max_bytes=3000)

    def entry(rid: str, size: int, status: str = "completed") -> StoredResponse:
        return StoredResponse.of({"id": rid, "status": status, "pad": "x" * size}, [], [])

    for k in range(5):
        assert store.put(entry(f"r{k}", 600))
        store.get("r0")  # r0 stays recently used
    assert store.used <= 3000 and store.get("r0") is not None and store.get("r1") is None
    assert sum(store.get(f"r{k}") is not None for k in range(5)) == len(store) == 4
    assert not store.put(entry("big", 4000)) and store.get("big") is None
    # A running background response is never dropped; when they fill the store a new one is refused.
    for k in range(4):
        assert store.put(entry(f"bg{k}", 600, "in_progress"))
    assert all(store.get(f"bg{k}") for k in range(4)) and store.running == store.used, "the finished ones went"
    assert not store.put(entry("bg4", 600, "queued")) and store.get("bg4") is None
    assert store.replace(entry("bg0", 600)) and store.running < store.used
    assert not store.replace(entry("gone", 10)) and store.get("gone") is None, "replace stores no new id"
    assert store.used == sum(e.size for e in store._entries.values())
    for rid in list(store._entries):
        assert store.delete(rid)
    assert store.used == store.running == 0


def test_a_background_response_runs_on_and_can_be_cancelled():
    async def run():
        serving = _serving(delay=0.05)
        reply = orjson.loads((await serving.create(_request({"input": "x", "background": True}))).body)
        assert reply["status"] == "queued" and reply["background"]
        await asyncio.sleep(0.3)
        done = orjson.loads(serving.retrieve(reply["id"]).body)
        assert done["status"] == "completed" and done["output"][0]["content"][0]["text"] == "Hello there"
        OpenAIResponse.model_validate(done)
        slow = _serving(delay=5.0)
        reply = orjson.loads((await slow.create(_request({"input": "x", "background": True}))).body)
        await asyncio.sleep(0.05)
        cancelled = orjson.loads((await slow.cancel(reply["id"])).body)
        assert cancelled["status"] == "cancelled" and not slow._background
        assert slow.tm.aborted == 1, "the generation was stopped"
        assert orjson.loads(slow.retrieve(reply["id"]).body)["status"] == "cancelled"
        # Deleted while running: the task stops and the response does not come back (review).
        gone = orjson.loads((await slow.create(_request({"input": "x", "background": True}))).body)
        await asyncio.sleep(0.05)
        await slow.delete(gone["id"])
        await asyncio.sleep(0.05)
        assert slow.store.get(gone["id"]) is None and not slow._background and slow.tm.aborted == 2
        with pytest.raises(RequestError):  # only background responses are cancelled
            await serving.cancel(orjson.loads((await serving.create(_request({"input": "x"}))).body)["id"])

    asyncio.run(run())


def test_custom_tools_are_shown_as_one_string_functions_and_called_as_custom_items():
    serving = _serving("<think>edit</think>" + PATCH)
    whole = _create(serving, tools=[PATCH_TOOL])
    shown = serving.tm.tokenizer.seen[-1]["tools"][0]["function"]
    assert shown["parameters"]["required"] == ["input"] and "start: /.+/" in shown["description"]
    assert whole["tools"] == [dict(PATCH_TOOL)], "echoed as the request gave it"
    (call,) = [i for i in whole["output"] if i["type"] == "custom_tool_call"]
    assert (call["name"], call["input"]) == ("apply_patch", "*** Begin Patch\n+x")
    # The call and its output sent back: what the model wrote, and a tool message.
    turn = [{"role": "user", "content": "weather?"}, call,
            {"type": "custom_tool_call_output", "call_id": call["call_id"], "output": "Done."}]  # fmt: skip
    (_, assistant, tool) = input_messages(turn)
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {"input": "*** Begin Patch\n+x"}
    assert tool == {"role": "tool", "tool_call_id": call["call_id"], "content": "Done."}
    # A forcing tool_choice names a custom tool as a function: the answer is held to one call of it.
    forced = _serving('[{"name": "apply_patch", "parameters": {"input": "+y"}}]')
    whole = _create(forced, tools=TOOLS + [PATCH_TOOL], tool_choice={"type": "custom", "name": "apply_patch"})
    assert [(i["type"], i.get("input")) for i in whole["output"]] == [("custom_tool_call", "+y")]
    schema = json.loads(forced.tm.params[-1]["json_schema"])
    assert schema["maxItems"] == 1 and schema["items"]["properties"]["name"] == {"type": "string", "enum": ["apply_patch"]}


def test_reasoning_comes_back_from_its_encrypted_content_alone():
    serving = _serving("<think>secret plan</think>" + CALL)
    whole = _create(serving, tools=TOOLS, include=["reasoning.encrypted_content"], store=False)
    reasoning = whole["output"][0]
    assert reasoning["type"] == "reasoning" and "secret plan" not in reasoning["encrypted_content"]
    bare = dict(reasoning, content=None)  # a client that keeps only the blob
    for item in (reasoning, bare):
        _create(serving, tools=TOOLS, input=[{"role": "user", "content": "weather?"}, item, *whole["output"][1:]])
    assert serving.tm.prompts[1] == serving.tm.prompts[2]
    assert serving.tm.tokenizer.seen[-1]["messages"][1]["reasoning_content"] == "secret plan"
    foreign = dict(bare, encrypted_content="gAAAAAB-someone-elses")
    assert input_messages([{"role": "user", "content": "x"}, foreign, {"role": "assistant", "content": "y"}])[1] == {
        "role": "assistant", "content": "y", "reasoning_content": ""}


def test_a_big_integer_or_a_null_switch_is_no_server_error():
    """Review: an integer past 64 bits in an echoed field made every reply fail to serialize (a 500 after
    the whole generation); OpenAI's null for a switch was a 400."""
    serving = _serving()
    raw = b'{"input": "x", "reasoning": {"x": 100000000000000000000000000000}, "store": null, "stream": null}'
    reply = orjson.loads(asyncio.run(serving.create(_request(raw))).body)
    assert reply["status"] == "completed" and reply["store"] is True and reply["reasoning"]["x"] == 1e29
    with pytest.raises(RequestError) as e:
        asyncio.run(serving.create(_request(b'{"input": "x", "max_output_tokens": 100000000000000000000000}')))
    assert e.value.param == "max_output_tokens"


def test_chat_names_do_not_leak_into_this_apis_errors():
    from sglang.srt.entrypoints.openai.responses_protocol import responses_error

    for message, param, want, want_param in [
        ("min_tokens must not exceed max_tokens.", "min_tokens", "min_tokens must not exceed max_output_tokens.",
         "min_tokens"),
        ("The messages input (9 tokens) is too long.", "messages", "The input (9 tokens) is too long.", "input"),
        ("messages[2].content: bad.", "messages[2].content", "input[2].content: bad.", "input[2].content"),
        ("response_format: bad.", "response_format", "text.format: bad.", "text.format"),
    ]:  # fmt: skip
        err = responses_error(RequestError(message, param))
        assert (err.message, err.param) == (want, want_param)
    # A grammar the route made from text.format, refused by the request checks (say, too deep).
    schema = {"type": "object"}
    serving = _serving(fail=RequestError("json_schema: nested too deep.", "sampling_params.json_schema"))
    with pytest.raises(RequestError) as e:
        _create(serving, text={"format": {"type": "json_schema", "name": "a", "schema": schema}})
    assert e.value.param == "text.format"


def test_a_failure_mid_stream_ends_it_with_events_the_openai_models_parse():
    from sglang.srt.managers.tokenizer_manager import ServerAbortError

    events = _create(_serving(fail=ServerAbortError(503, "The server is shutting down.")), stream=True)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"]
    assert events[-1]["response"]["error"] == {"code": "server_error", "message": "The server is shutting down."}


def test_encrypted_reasoning_is_bounded_by_the_context():
    from sglang.srt.entrypoints.openai.responses_items import encode_reasoning

    serving = _serving()
    serving.tm.limits.context_len = 1000  # 16,000 characters of reasoning at most
    bomb = {"type": "reasoning", "summary": [], "encrypted_content": encode_reasoning("a" * 100_000)}
    with pytest.raises(RequestError) as e:
        _create(serving, input=[{"role": "user", "content": "x"}, bomb, bomb])
    assert e.value.param == "input[1].encrypted_content" and serving.tm.prompts == []
    small = dict(bomb, encrypted_content=encode_reasoning("a" * 10_000))
    _create(serving, input=[{"role": "user", "content": "x"}, small, {"role": "assistant", "content": "y"}])


@pytest.mark.parametrize("answer, finish", [("1 < 2", "stop"), ("\n\nHi", "stop"), ("x <tool", "length"),
                                            ("<think>p</think>\n\n\n", "stop")])  # fmt: skip
def test_a_held_tokens_logprobs_come_with_the_text_it_releases(answer, finish):
    """Review: tokens whose text the parsers held (a partial tag, leading whitespace) lost their logprobs;
    the one-character tokens of the fake must spell the message exactly."""
    for stream in (False, True):
        out = _create(_serving(answer, finish=finish), stream=stream, tools=TOOLS,
                      include=["message.output_text.logprobs"])  # fmt: skip
        out = out[-1]["response"] if stream else out
        (message,) = [i for i in out["output"] if i["type"] == "message"]
        text = message["content"][0]["text"]
        assert "".join(e["token"] for e in message["content"][0]["logprobs"]) == text, (stream, text)


def test_reasoning_with_no_answer_after_it_stays_in_its_own_turn():
    """Review: a turn cut while reasoning was glued onto the next turn's answer."""
    cut = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "old plan"}]}
    messages = input_messages([{"role": "user", "content": "q1"}, cut, {"role": "user", "content": "q2"},
                               {"role": "assistant", "content": "a2"}])  # fmt: skip
    assert messages == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": None, "reasoning_content": "old plan"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2"},
    ]


def test_a_background_response_always_ends_even_when_its_end_does_not_fit():
    """Review: a finished background response larger than the room left stayed in_progress for ever
    (and held the store against every other background request); one cancelled before its task ran
    stayed queued."""

    async def run():
        serving = _serving("x" * 2000)
        reply = orjson.loads((await serving.create(_request({"input": "x", "background": True}))).body)
        serving.store.max_bytes = serving.store.used + 100  # the end (2,000 more bytes) cannot fit
        await asyncio.sleep(0.2)
        ended = orjson.loads(serving.retrieve(reply["id"]).body)
        assert ended["status"] == "failed" and "--response-store-max-mb" in ended["error"]["message"]
        assert serving.store.running == 0 and not serving._background
        OpenAIResponse.model_validate(ended)
        serving.store.max_bytes = 1 << 20
        early = orjson.loads((await serving.create(_request({"input": "x", "background": True}))).body)
        serving._background[early["id"]].cancel()  # before its first step
        await asyncio.sleep(0.05)
        assert orjson.loads(serving.retrieve(early["id"]).body)["status"] == "cancelled"
        assert serving.store.running == 0
        with pytest.raises(RequestError):
            serving.input_items(early["id"], limit="\u00b2")  # (a digit int() refuses: was a 500)

    asyncio.run(run())


def test_a_reply_too_large_to_store_says_it_was_not_stored():
    serving = _serving("x" * 5000)
    serving.store.max_bytes = 4000
    for stream in (False, True):
        reply = _create(serving, stream=stream)
        reply = reply[-1]["response"] if stream else reply
        assert reply["store"] is False and len(serving.store) == 0


def test_a_stream_quiet_through_a_long_call_sends_keepalive_comments(monkeypatch):
    from sglang.srt.entrypoints import stream_keepalive

    monkeypatch.setattr(stream_keepalive, "KEEPALIVE_SECONDS", 0.0)

    async def chunks():
        reply = await _serving("<think>plan</think>" + CALL).create(_request({"input": "x", "tools": TOOLS, "stream": True}))
        return [chunk async for chunk in reply.body_iterator]

    raw = asyncio.run(chunks())
    assert b": keepalive\n\n" in raw, "the call's chunks send nothing else"
    events = [_event(c) for c in raw if not c.startswith(b":")]
    assert events[-1]["type"] == "response.completed"


def test_parallel_tool_calls_false_gives_one_call():
    for stream in (False, True):
        out = _create(_serving(CALL + "\n" + CALL), stream=stream, tools=TOOLS, parallel_tool_calls=False)
        out = out[-1]["response"] if stream else out
        assert [i["type"] for i in out["output"]] == ["function_call"] and out["parallel_tool_calls"] is False


PIECES = ["x", "Hi", " ", "\n", "<", "<t", "<tool", "<think>", "</think>", "plan", CALL, "</tool_call>", "{"]


@settings(max_examples=60, deadline=None, derandomize=True)
@given(parts=st.lists(st.sampled_from(PIECES), max_size=8), cut=st.booleans())
def test_the_messages_logprob_tokens_spell_its_text_for_any_answer(parts, cut):
    """Review: held text released for older tokens was given to the newest; the end's release missed the
    last delta. One-character tokens (the fake's) spell the message exactly, whole and streamed, and the
    deltas' logprobs add up to the message's."""
    answer = "".join(parts)
    include = ["message.output_text.logprobs"]
    whole = _create(_serving(answer, finish="length" if cut else "stop"), tools=TOOLS, include=include)
    events = _create(_serving(answer, finish="length" if cut else "stop"), stream=True, tools=TOOLS, include=include)
    for out in (whole, events[-1]["response"]):
        for message in [i for i in out["output"] if i["type"] == "message"]:
            part = message["content"][0]
            assert "".join(e["token"] for e in part["logprobs"]) == part["text"], (answer, part["text"])
    deltas = [e for ev in events if ev["type"] == "response.output_text.delta" for e in ev["logprobs"]]
    final = [i for i in events[-1]["response"]["output"] if i["type"] == "message"]
    assert deltas == (final[0]["content"][0]["logprobs"] if final else [])


def test_multi_character_tokens_count_where_their_characters_are_the_messages():
    from sglang.srt.entrypoints.openai.responses_output import ContentTokens
    from sglang.srt.function_call.function_call_parser import ToolCallParser
    from sglang.srt.parser.reasoning_parser import FORMATS, ReasoningParser

    tokens = ["Use", " <", "<tool_call>", '\n{"name": "f", "arguments": {}}\n', "</tool_call>"]
    counter = ContentTokens(ReasoningParser(FORMATS["qwen3"]), ToolCallParser({"f": {}}), forced=False)
    kept = counter.keep([{"token": t} for t in tokens]) + counter.finish()
    assert [e["token"] for e in kept] == ["Use", " <"], "the call's opening token is not the message's"


def test_queued_responses_reserve_the_room_their_in_progress_takes():
    """Review: each queued -> in_progress replace grew the store 5 bytes past its bound."""
    one = StoredResponse.of({"id": "r0", "status": "queued", "pad": "x" * 50}, [], [])
    store = ResponseStore(max_bytes=10 * one.size)
    for k in range(10):
        assert store.put(StoredResponse.of({"id": f"r{k}", "status": "queued", "pad": "x" * 50}, [], []))
    for k in range(10):
        assert store.replace(StoredResponse.of({"id": f"r{k}", "status": "in_progress", "pad": "x" * 50}, [], []))
    assert store.used <= store.max_bytes and store.running == store.used


def test_a_long_answers_logprobs_are_built_off_the_event_loop():
    """A client asking a long answer's logprobs stalls the others no longer than the bound below: the
    reply (the chat route's choice, the message's tokens, the items) is built on a thread past
    tokenizer_output's OFF_LOOP_ENTRIES. 60,000 one-character tokens measured 0.06-0.17 s of stall
    built off the loop and 2.0-2.1 s on it (2-core host); 0.8 s leaves room for a slower one."""
    from sglang.test.app_harness import LoopBystander

    async def stall() -> float:
        serving = _serving("ab " * 20_000)
        serving.store.max_bytes = 1 << 26
        async with LoopBystander() as bystander:
            reply = await serving.create(_request({"input": "x", "include": ["message.output_text.logprobs"]}))
        assert len(orjson.loads(reply.body)["output"][0]["content"][0]["logprobs"]) == 60_000
        return bystander.worst

    worst = asyncio.run(stall())
    assert worst < 0.8, worst
