"""A grammar after the model's reasoning, and --enable-strict-thinking (constrained/reasoning_grammar.py):
the phases token by token against a multi-token think-end marker (the tiny presets' tokenizer has no
`</think>` token: it is 6 tokens), the budget's forced tokens (a marker the model began is finished, and
its tokens do not count), the tokens banned while thinking, the inner grammar seeing only what follows
the marker; then through a real engine: a budget and a regex give the budget's thinking tokens, the
marker, and text the regex matches."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch

import sglang
from sglang.srt.constrained.reasoning_grammar import ReasoningGrammar, ReasoningTokens
from sglang.srt.constrained.vocab_mask import allowed_tokens
from sglang.srt.constrained.xgrammar_backend import GrammarRejectedToken
from sglang.srt.managers.request_error import RequestError
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=12, suite="per-commit-cpu")

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


def test_the_budget_forces_the_marker_and_counts_none_of_it():
    g = ReasoningGrammar(None, tokens(), 3)
    out = [5, 6]
    g.catch_up(out)
    assert allowed(g) == set(range(512)) - {EOS, TOOL}  # strict: no end, no tool call while thinking
    out += [30]  # the marker's first token: it does not count, so one more thinking token is allowed
    g.catch_up(out)
    assert g.forced() is None
    out += [8]
    g.catch_up(out)
    assert g.count == 4 and g.matched == 0 and g.forced() == END[0]
    for k, token in enumerate(END):
        assert allowed(g) == {token}, k
        out.append(token)
        g.catch_up(out)
    assert not g.thinking and allowed(g) == set(range(512)) and g.accepted == len(out)
    with pytest.raises(GrammarRejectedToken):  # a token the budget did not allow (the mask forbade it)
        bad = ReasoningGrammar(None, tokens(), 0)
        bad.catch_up([5])
    with pytest.raises(GrammarRejectedToken):
        ReasoningGrammar(None, tokens(), -1).catch_up([EOS])
    # A marker the model began when the budget runs out is finished, not started again.
    g = ReasoningGrammar(None, tokens(), 1)
    g.catch_up([5, 30, 17])
    assert g.forced() == END[2] and g.count - g.matched == 1


def test_a_budget_needs_strict_thinking_and_the_default_is_the_env():
    assert tokens(strict=False).grammar(None, 5) is None  # nothing to hold: no grammar, not strict
    assert tokens(strict=False).grammar(Inner(), 5).budget == -1
    assert tokens(budget=7).grammar(None, None).budget == 7 and tokens(budget=7).grammar(None, 2).budget == 2
    assert tokens().grammar(None, True).budget == -1  # (not an integer: the default)


@pytest.fixture(scope="module")
def engine():
    eng = sglang.Engine(model_path="tiny-qwen3-next", reasoning_parser="qwen3", enable_strict_thinking=True)
    yield eng
    eng.shutdown()


def test_a_budget_then_a_regex_through_the_engine(engine):
    tok = engine.tokenizer_manager.tokenizer
    end = tok.encode("</think>", add_special_tokens=False)
    assert tuple(end) == END
    params = {"max_new_tokens": 40, "temperature": 0.7, "sampling_seed": 3, "regex": "[0-9]{4}"}
    out = engine.generate(
        input_ids=[5, 6, 7], sampling_params=params, require_reasoning=True, max_thinking_tokens=4
    )
    ids = out["output_ids"]
    assert tuple(ids[4:10]) == END and EOS not in ids[:4], ids
    assert re.fullmatch(r"[0-9]{4}", tok.decode(ids[10:], skip_special_tokens=True)), out["text"]
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    # Without require_reasoning the regex holds from the first token (as before).
    plain = engine.generate(input_ids=[5, 6, 7], sampling_params=params)
    assert re.fullmatch(r"[0-9]{4}", plain["text"]), plain["text"]
    for body, param in [
        ({"max_thinking_tokens": -1}, "max_thinking_tokens"),
        ({"require_reasoning": "yes"}, "require_reasoning"),
    ]:
        with pytest.raises(RequestError) as e:
            engine.generate(input_ids=[5], sampling_params=params, **body)
        assert e.value.param == param


def test_the_limits_refuse_what_the_server_cannot_serve():
    from sglang.srt.managers.reasoning_control import check_reasoning

    none = SimpleNamespace(reasoning_parser=False, strict_thinking=False)
    parser = SimpleNamespace(reasoning_parser=True, strict_thinking=False)
    assert "--reasoning-parser" in _refusal(check_reasoning, True, None, none)
    assert "--enable-strict-thinking" in _refusal(check_reasoning, True, 5, parser)
    assert check_reasoning(True, None, parser) == (True, None)


def _refusal(fn, *args) -> str:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return e.value.message
