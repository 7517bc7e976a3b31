"""A grammar after the model's reasoning, and --enable-strict-thinking (constrained/reasoning_grammar.py):
the phases token by token against a multi-token think-end marker (the tiny presets' tokenizer has no
`</think>` token: it is 6 tokens), the budget's forced tokens (a marker the model began is finished, and
its tokens do not count), the tokens banned while thinking, the inner grammar seeing only what follows
the marker; then through a real engine: a budget and a regex give the budget's thinking tokens, the
marker, and text the regex matches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.constrained.reasoning_grammar import ReasoningGrammar, ReasoningTokens
from sglang.srt.constrained.vocab_mask import allowed_tokens
from sglang.srt.constrained.xgrammar_backend import GrammarRejectedToken
from sglang.srt.environ import envs
from sglang.srt.managers.request_error import RequestError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=20, suite="per-commit-cpu")

QWEN = "tiny-qwen3-next"

END = (30, 17, 502, 264, 77, 32)  # "</think>" in the tiny presets' tokenizer
EOS, TOOL = 2, 9
VOCAB = 100


def tokens(strict: bool = True, budget: int = -1) -> ReasoningTokens:
    return ReasoningTokens(END, (EOS, TOOL), strict, budget, 512)


def allowed(grammar) -> set[int]:
    bitmask = torch.full((1, 512 // 32), -1, dtype=torch.int32)
    grammar.fill(bitmask, 0)
    return set(torch.nonzero(allowed_tokens(bitmask, 512)[0]).flatten().tolist())


class Inner:
    """A stand-in for `RequestGrammar`: records what it accepts, allows only token 7, ends after two."""

    def __init__(self):
        self.seen, self.accepted, self.spent = [], 0, 0.0

    def catch_up(self, output_ids, offset=0):
        new = output_ids[offset + self.accepted :]
        self.seen += new
        self.accepted += len(new)

    def fill(self, bitmask, row):
        bitmask[row] = 0
        bitmask[row, 0] = 1 << 7

    @property
    def terminated(self):
        return self.accepted >= 2

    def take_spent(self):
        return 0.0


def test_the_grammar_starts_after_the_marker_and_sees_only_what_follows():
    inner = Inner()
    g = ReasoningGrammar(inner, tokens(strict=False), -1)
    out = [5, 30, 4, 30, 17, 502]  # a false start of the marker, then half of it
    g.catch_up(out)
    assert g.thinking and g.matched == 3 and allowed(g) == set(range(512))  # not strict: nothing banned
    out += [264, 77, 32]
    g.catch_up(out)
    assert not g.thinking and g.think_len == 9 and allowed(g) == {7} and inner.seen == []
    out += [7, 7]
    g.catch_up(out)
    assert inner.seen == [7, 7] and g.accepted == 11 and g.terminated


def force_through(g: ReasoningGrammar, out: list[int]) -> list[int]:
    """Take the tokens the budget forces, checking that the mask allows each alone."""
    while g.forced() is not None:
        token = g.forced()
        assert allowed(g) == {token}
        out.append(token)
        g.catch_up(out)
    return out


def test_the_budget_counts_the_sampled_thinking_tokens_and_forces_the_marker():
    g = ReasoningGrammar(None, tokens(), 3)
    out = [5, 6]
    g.catch_up(out)
    assert allowed(g) == set(range(512)) - {EOS, TOOL}  # strict: no end, no tool call while thinking
    out += [8]
    g.catch_up(out)
    assert force_through(g, out) == [5, 6, 8, *END] and not g.thinking and g.released
    assert allowed(g) == set(range(512)) and g.accepted == len(out)
    # A marker the model began when the budget runs out is finished, not begun again; one it began and
    # left counts as thinking (3 sampled tokens, then the whole marker).
    g = ReasoningGrammar(None, tokens(), 3)
    assert force_through(g, g.catch_up([5, 6, 30]) or [5, 6, 30]) == [5, 6, *END]
    g = ReasoningGrammar(None, tokens(), 3)
    assert force_through(g, g.catch_up([30, 17, 8]) or [30, 17, 8]) == [30, 17, 8, *END]
    assert force_through(ReasoningGrammar(None, tokens(), 0), []) == list(END)  # budget 0: at once
    with pytest.raises(GrammarRejectedToken):  # a token the budget did not allow (the mask forbade it)
        ReasoningGrammar(None, tokens(), 0).catch_up([5])
    with pytest.raises(GrammarRejectedToken):
        ReasoningGrammar(None, tokens(), -1).catch_up([EOS])
    assert not ReasoningGrammar(Inner(), tokens(), 0).released  # (a grammar follows: it stays)


def test_a_budget_needs_strict_thinking_and_the_default_is_the_env():
    assert tokens(strict=False).grammar(None, 5) is None  # nothing to hold: no grammar, not strict
    assert tokens(strict=False).grammar(Inner(), 5).budget == -1
    assert tokens(budget=7).grammar(None, None).budget == 7 and tokens(budget=7).grammar(None, 2).budget == 2
    assert tokens().grammar(None, True).budget == -1  # (not an integer: the default)
    tok = SimpleNamespace(
        encode=lambda text, add_special_tokens: {"</think>": list(END), "<tool_call>": [TOOL]}.get(
            text, [1, 2]
        )
    )
    args = SimpleNamespace(reasoning_parser="qwen3", enable_strict_thinking=True)
    with envs.SGLANG_MAX_THINK_TOKENS.override(11):
        made = ReasoningTokens.create(args, tok, 512, {EOS, 600})
    assert (made.end_ids, made.excluded, made.strict, made.default_budget) == (END, (EOS, TOOL), True, 11)
    assert ReasoningTokens.create(args, tok, 100, {EOS}) is None  # the marker is past the logits
    assert ReasoningTokens.create(SimpleNamespace(reasoning_parser=None), tok, 512, set()) is None


def test_a_request_without_a_grammar_drops_its_mask_when_its_thinking_ends():
    """Under strict thinking a request's thinking holds a mask; once the marker is out and no grammar
    follows, the scheduler drops it, so the request drafts again (NGRAM proposed nothing for its whole
    life) and decodes as a plain request does."""
    h = SchedulerHarness(QWEN, speculative_algorithm="NGRAM", speculative_num_draft_tokens=4,
                         reasoning_parser="qwen3", enable_strict_thinking=True, disable_overlap_schedule=True)  # fmt: skip
    prompt = token_ids(12, seed=4) * 4  # (repeats: drafts to propose)
    a = h.submit(prompt, max_new_tokens=40, require_reasoning=True, custom_params={"thinking_budget": 0})
    h.run()
    out = h.outputs[a].output_ids
    assert tuple(out[:6]) == END and h.sched.spec.stats["verify_steps"] > 0
    assert h.sched.grammar_queue.held == 0
    b = h.submit(prompt + list(END), max_new_tokens=34)
    h.run()
    assert h.outputs[b].output_ids == out[6:]
    h.shutdown()


def test_a_tags_last_place_in_token_ids():
    from sglang.srt.parser.reasoning_parser import last_index

    ids = [7, 1, 2, 9, 1, 2, 5] + [0x0201, 0x0100]  # (the last two's bytes hold 1, 2 across a word boundary)
    assert last_index(ids, [1, 2]) == 4 and last_index(ids, [2, 5]) == 5 and last_index(ids, [3]) == -1
    assert last_index(ids, []) == -1 and last_index([], [1]) == -1
    assert last_index([0x0100, 0x0002], [1 << 16 | 0x0100 >> 8]) == -1  # a misaligned match only


def test_the_limits_refuse_what_the_server_cannot_serve():
    from sglang.srt.managers.reasoning_control import check_reasoning

    none = SimpleNamespace(reasoning_parser=False, strict_thinking=False)
    parser = SimpleNamespace(reasoning_parser=True, strict_thinking=False)
    assert "--reasoning-parser" in _refusal(check_reasoning, True, None, none)
    assert "--enable-strict-thinking" in _refusal(check_reasoning, True, 5, parser)
    assert "require_reasoning" in _refusal(check_reasoning, False, 5, parser)
    assert check_reasoning(True, None, parser) == (True, None)


def _refusal(fn, *args) -> str:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return e.value.message


@pytest.mark.parametrize(
    "parser, prefix, tools, expected",
    [
        ("qwen3", None, False, False),  # the template opens no think block: the grammar holds at once
        ("qwen3", "<think>\n", False, True),  # a continued message opens one
        ("qwen3", "<think>\nok</think>\n", False, False),  # and closes it
        ("qwen3", "<think>\n", True, False),  # a forced tool call leaves no room for reasoning
        ("qwen3-thinking", None, False, True),  # its models think first, the opening tag left out
        ("qwen3-thinking", "ok</think>\n", False, False),  # (the review's case: it waited forever)
        ("deepseek-r1", "<think>\nok</think>\n", False, False),
        (None, "<think>\n", False, False),  # no parser: nothing is waited for
    ],
)
@pytest.mark.parametrize("pretokenized", [False, True], ids=["template", "input_ids"])
def test_the_chat_route_requires_reasoning_where_the_answer_starts_in_it(
    parser, prefix, tools, expected, pretokenized
):
    import asyncio

    from sglang.srt.entrypoints.openai.protocol import ChatCompletionRequest
    from sglang.srt.entrypoints.openai.serving_chat import OpenAIServingChat
    from sglang.test.fake_chat import FakeChatTokenizerManager

    serving = OpenAIServingChat(FakeChatTokenizerManager("x"), "m", reasoning_parser=parser)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "regex": "[0-9]+"}
    if prefix is not None:
        body |= {
            "messages": body["messages"] + [{"role": "assistant", "content": prefix}],
            "continue_final_message": True,
        }
    if tools:
        tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
        body |= {"tools": [tool], "tool_choice": "required", "regex": None}
    if (
        pretokenized
    ):  # (the same prompt as the client's own ids: read from its tags' ids, whatever its length)
        # (a long history; with a closed block in it where the parser's model opens its own tag: for an
        # always-thinking parser a closed block with no opening tag after it reads as closed)
        always = parser in ("qwen3-thinking", "deepseek-r1")
        history = (
            "<assistant>" + "x" * 300 + ("" if always else "<think>a</think>b")
            if prefix is None or tools
            else ""
        )
        body |= {"input_ids": [ord(c) for c in "<user>|hi" + history + (prefix or "<assistant>")]}
    obj = asyncio.run(serving.to_generate_input(ChatCompletionRequest.model_validate(body)))
    assert obj.require_reasoning is expected
