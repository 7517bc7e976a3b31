"""`--reasoning-parser`: a chat answer's reasoning into `reasoning_content`, whole and streamed; any
cutting of the answer into streamed pieces gives what the whole answer gives."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
from sglang.srt.entrypoints.openai.serving_base import parse_model
from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
from sglang.srt.parser.reasoning_parser import FORMATS, ReasoningParser, prompt_opens_reasoning
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


def parse(fmt: str, text: str, opens: bool = False) -> tuple[str | None, str]:
    return ReasoningParser(FORMATS[fmt], opens).parse(text)


@pytest.mark.parametrize(
    "fmt, opens, text, want",
    [
        ("qwen3", False, "<think>\nhm\n</think>\n\nIt is 4.", ("\nhm\n", "\n\nIt is 4.")),
        ("qwen3", False, "  <think>hm</think>ok", ("hm", "ok")),  # leading whitespace before the tag
        ("qwen3", False, "It is 4.", (None, "It is 4.")),  # enable_thinking false: no reasoning
        ("qwen3", False, "It is <think>4</think>.", (None, "It is <think>4</think>.")),  # not at the start
        ("qwen3", True, "hm</think>It is 4.", ("hm", "It is 4.")),  # the template opened the block
        ("qwen3", True, "hm, cut off", ("hm, cut off", "")),  # cut off inside the reasoning
        ("qwen3", False, "<think>hm<tool_call>{}</tool_call>", ("hm", "<tool_call>{}</tool_call>")),
        ("deepseek-r1", False, "hm</think>It is 4.", ("hm", "It is 4.")),  # R1: always starts reasoning
        ("deepseek-r1", False, "<think>hm</think>4", ("hm", "4")),
        ("deepseek-r1", False, "a <tool_call> b</think>c", ("a <tool_call> b", "c")),  # only </think> ends
        ("qwen3", True, "</thi", ("</thi", "")),  # a partial tag at the end is text
        ("qwen3-thinking", False, "hm</think>4", ("hm", "4")),
        ("qwen3", False, "<thi", (None, "<thi")),
        # Nemotron 3: the template opens the block; a tool call may end it without </think>.
        ("nemotron_3", True, "hm<tool_call>\n<function=f>", ("hm", "<tool_call>\n<function=f>")),
        ("nano_v3", False, "It is 4.", (None, "It is 4.")),  # enable_thinking false
    ],
)
def test_whole_answers(fmt, opens, text, want):
    assert parse(fmt, text, opens) == want


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking off
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


pieces = st.lists(st.sampled_from(["<think>", "</think>", "<thi", "nk>", "</", "think>", "<tool_call>", "a", " ", "\n"]))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(parts=pieces, cuts=st.lists(st.integers(0, 200)), fmt=st.sampled_from(sorted(FORMATS)), opens=st.booleans())
def test_any_cutting_streams_what_the_whole_answer_gives(parts, cuts, fmt, opens):
    text = "".join(parts)
    reasoning, content = parse(fmt, text, opens)
    bounds = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    parser = ReasoningParser(FORMATS[fmt], opens)
    got_r = got_c = ""
    for a, b in zip(bounds, bounds[1:], strict=False):
        r, c = parser.feed(text[a:b])
        got_r, got_c = got_r + r, got_c + c
    r, c = parser.finish()
    assert (got_r + r, got_c + c) == (reasoning or "", content)


# ---- the chat route ---------------------------------------------------------------------------------


class _Template:
    """A chat template that opens a think block unless enable_thinking is false (as Qwen3's), or adds
    no think tags at all with `instruct` (as an Instruct model's)."""

    chat_template = "qwen3-like"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **variables):
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        if not add_generation_prompt:
            return text
        opened = "<think>\n" if variables.get("enable_thinking", True) else "<think>\n\n</think>\n\n"
        return text + "<assistant>" + ("" if variables.get("instruct") else opened)


def _serving(parser: str | None = "qwen3") -> OpenAIServingChat:
    async def encode(text, param, add_special_tokens=True, truncate=False):
        return [ord(c) % 50 for c in text]

    tm = SimpleNamespace(tokenizer=_Template(), encode=encode, limits=SimpleNamespace(context_len=4096))
    return OpenAIServingChat(tm, "m", reasoning_parser=parser)


def _request(serving: OpenAIServingChat, messages=None, **body) -> ChatCompletionRequest:
    messages = messages or [{"role": "user", "content": "q"}]
    req = parse_model(ChatCompletionRequest, orjson.dumps({"messages": messages, **body}))
    asyncio.run(serving.to_generate_input(req))  # renders the template: whether it opened the block
    return req


def _out(text: str, finished: bool = True) -> dict:
    meta = {"finish_reason": {"type": "stop", "matched": 2} if finished else None}
    return {"text": text, "meta_info": meta}


ANSWER = "I think.\n</think>\n\nIt is 4."


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_the_chat_route_splits_whole_and_streamed_answers(stream_reasoning):
    serving = _serving()
    req = _request(serving, stream_reasoning=stream_reasoning)
    message = serving.make_choice(req, 0, _out(ANSWER)).message
    assert (message.reasoning_content, message.content) == ("I think.\n", "\n\nIt is 4.")
    progress: dict = {}
    reasoning = content = ""
    chunks = []
    for k, piece in enumerate(["I th", "ink.\n</th", "ink>\n\nIt", " is 4."]):
        for choice in serving.stream_choices(req, 0, piece, _out("", finished=k == 3)["meta_info"], progress):
            chunks.append(choice)
            reasoning += choice.delta.reasoning_content or ""
            content += choice.delta.content or ""
    assert (reasoning, content) == ("I think.\n", "\n\nIt is 4.")
    assert chunks[-1].finish_reason == "stop" and chunks[-1].delta.model_dump() == {}
    sent = [c.delta.reasoning_content for c in chunks if c.delta.reasoning_content]
    assert len(sent) == (1 if not stream_reasoning else 2), "held until the reasoning ends, or as it comes"


def test_tags_in_the_messages_do_not_open_the_reasoning():
    """Only the template's own tail decides: a system prompt about <think> (an Instruct model never
    closes it) and a continued answer's text in the middle leave the answer's start alone."""
    serving = _serving()
    about = [{"role": "system", "content": "Wrap reasoning in <think> tags."}, {"role": "user", "content": "q"}]
    off = _request(serving, about, chat_template_kwargs={"instruct": True})
    message = serving.make_choice(off, 0, _out("Hello!")).message
    assert (message.reasoning_content, message.content) == (None, "Hello!")
    cont = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>a</think>The answer"}]
    req = _request(serving, cont, continue_final_message=True, chat_template_kwargs={"instruct": True})
    message = serving.make_choice(req, 0, _out("<think> is a tag")).message
    assert (message.reasoning_content, message.content) == (None, "<think> is a tag"), "mid-answer: text"
    opened = _request(serving, [*cont[:1], {"role": "assistant", "content": "<think>\nso"}], continue_final_message=True,
                      chat_template_kwargs={"instruct": True})  # fmt: skip
    message = serving.make_choice(opened, 0, _out(" far</think>ok")).message
    assert (message.reasoning_content, message.content) == (" far", "ok"), "a continued open block"


def test_streams_of_several_choices_and_a_held_partial_tag():
    serving = _serving()
    req = _request(serving, n=2)
    progress: dict = {}
    got = {0: ["", ""], 1: ["", ""]}
    steps = [(0, "a</thi", False), (1, "b</think>B", False), (0, "", True), (1, "!", True)]
    for index, piece, last in steps:
        for choice in serving.stream_choices(req, index, piece, _out("", finished=last)["meta_info"], progress):
            got[index][0] += choice.delta.reasoning_content or ""
            got[index][1] += choice.delta.content or ""
    assert got == {0: ["a</thi", ""], 1: ["b", "B!"]}, "the held '</thi' is flushed as reasoning at the end"


def test_thinking_off_and_separate_reasoning_false_keep_the_text():
    serving = _serving()
    off = _request(serving, chat_template_kwargs={"enable_thinking": False})
    message = serving.make_choice(off, 0, _out("It is 4.")).message
    assert (message.reasoning_content, message.content) == (None, "It is 4.")
    raw = _request(serving, separate_reasoning=False)
    assert serving.make_choice(raw, 0, _out(ANSWER)).message.content == ANSWER
    assert _serving(None).make_choice(_request(_serving(None)), 0, _out(ANSWER)).message.content == ANSWER


def test_a_long_run_of_leading_whitespace_fed_a_token_at_a_time_is_linear():
    """Review: the start of an answer re-stripped the whole buffer at every token (65,536 whitespace
    tokens: 2.7 s on the event loop). Work 4x the tokens: a linear parser takes ~4x as long, the quadratic
    one took ~16x (best of three each, so that a stall of the machine does not decide)."""
    import time

    def seconds(n: int) -> float:
        best = float("inf")
        for _ in range(3):
            parser = ReasoningParser(FORMATS["qwen3"])
            start = time.perf_counter()
            for _ in range(n):
                parser.feed("\n")
            best = min(best, time.perf_counter() - start)
        return best

    small, large = seconds(8_000), seconds(32_000)
    assert large / small < 10, (small, large)
    parser = ReasoningParser(FORMATS["qwen3"])
    for piece in ["\n"] * 5 + ["<thi", "nk>", "plan</think>", "answer"]:
        parser.feed(piece)
    assert parser.saw_reasoning and not parser.in_reasoning
