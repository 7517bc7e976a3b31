"""A model's reasoning before its grammar (upstream's reasoner grammar), and `--enable-strict-thinking`.

With `--reasoning-parser`, a request whose answer starts inside the model's reasoning
(`require_reasoning`: the chat routes set it where the template leaves a think block open) is in its
*thinking* phase until the output holds the think-end marker (`</think>`, as the tokenizer encodes it:
one token on Qwen3, several on a tokenizer without it); only then does its grammar (json_schema, regex,
...) constrain it. Before this, a grammar constrained the reasoning itself: a thinking model's JSON
landed in `reasoning_content` and its answer stayed empty.

`--enable-strict-thinking` (upstream's) also makes every such request hold a `ReasoningGrammar` (with or
without a grammar after it): while thinking it may not end or call a tool (the end-of-sequence ids and
the single-token tool-call tags are masked), and its thinking budget (`max_thinking_tokens`, or
`sampling_params.custom_params["thinking_budget"]`, else SGLANG_MAX_THINK_TOKENS; -1: none) counts the
thinking tokens it samples: once they reach it, the next tokens are forced to the rest of the think-end
marker (a marker the model began is finished, not begun again), so a budget of N gives N sampled
tokens, then the marker's forced ones. A request whose thinking ended with no grammar after it drops its
`ReasoningGrammar` (`released`): it drafts again, and the overlap schedule looks ahead again.

The object has `RequestGrammar`'s interface (`catch_up`, `fill`, `terminated`, `accepted`, `stopped`,
`take_spent`), so the scheduler's masks, finish checks and output budget treat it as any grammar.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.constrained.output_check_budget import clock
from sglang.srt.constrained.xgrammar_backend import GrammarRejectedToken
from sglang.srt.environ import envs
from sglang.srt.parser.reasoning_parser import THINK_END

if TYPE_CHECKING:
    from sglang.srt.constrained.xgrammar_backend import RequestGrammar

logger = logging.getLogger(__name__)

# Banned while thinking under strict thinking, where each is one token (upstream's Qwen3 list: these and
# the end-of-sequence ids).
TOOL_TAGS = ("<tool_call>", "</tool_call>")


@dataclass(frozen=True)
class ReasoningTokens:
    """The server's reasoning markers as token ids, and its strict thinking settings."""

    end_ids: tuple[int, ...]  # the think-end marker
    excluded: tuple[int, ...]  # masked while thinking (strict thinking only)
    strict: bool
    default_budget: int  # SGLANG_MAX_THINK_TOKENS: -1, none
    vocab_size: int

    @classmethod
    def create(
        cls, server_args: Any, tokenizer: Any, vocab_size: int, eos_ids: set[int]
    ) -> ReasoningTokens | None:
        """None without --reasoning-parser or a tokenizer (nothing knows the markers)."""
        if not server_args.reasoning_parser or tokenizer is None:
            return None
        end_ids = tuple(tokenizer.encode(THINK_END, add_special_tokens=False))
        if not end_ids or max(end_ids) >= vocab_size:  # (a token past the logits: nothing could force it)
            logger.warning("%s encodes to %s, outside the model's %d logits: grammars start at the first token.",
                           THINK_END, end_ids, vocab_size)  # fmt: skip
            return None
        tags = [tokenizer.encode(tag, add_special_tokens=False) for tag in TOOL_TAGS]
        excluded = {t for t in eos_ids} | {ids[0] for ids in tags if len(ids) == 1}
        excluded = sorted(t for t in excluded if t < vocab_size)
        strict = bool(server_args.enable_strict_thinking)
        return cls(end_ids, tuple(excluded), strict, envs.SGLANG_MAX_THINK_TOKENS.get(), vocab_size)

    def grammar(self, inner: RequestGrammar | None, budget: Any) -> ReasoningGrammar | RequestGrammar | None:
        """What a request that requires reasoning holds: its grammar after the reasoning, and under strict
        thinking one even without a grammar (`budget`: its thinking_budget custom param, if any)."""
        if inner is None and not self.strict:
            return None
        if not self.strict:
            budget = -1  # (upstream's rule: a budget needs strict thinking)
        elif not isinstance(budget, int) or isinstance(budget, bool):
            budget = self.default_budget
        return ReasoningGrammar(inner, self, budget)


class ReasoningGrammar:
    __slots__ = ("inner", "tokens", "budget", "vocab_size", "accepted", "thinking", "count", "forced_n",
                 "matched", "tail", "think_len", "spent", "stopped")  # fmt: skip

    def __init__(self, inner: RequestGrammar | None, tokens: ReasoningTokens, budget: int):
        self.inner = inner
        self.tokens = tokens
        self.budget = budget  # thinking tokens it may sample (-1: any number)
        self.vocab_size = tokens.vocab_size
        self.accepted = 0  # output tokens taken (its thinking's, then its grammar's)
        self.thinking = True
        self.count = 0  # thinking tokens taken, the marker's included
        self.forced_n = 0  # of them, the ones the budget forced
        self.matched = 0  # how much of the think-end marker the output ends with
        self.tail: tuple[int, ...] = ()  # its last thinking tokens (as many as the marker has)
        self.think_len = 0  # the output tokens of the thinking phase, its marker included
        self.spent = 0.0
        self.stopped = False

    @property
    def terminated(self) -> bool:
        return not self.thinking and self.inner is not None and self.inner.terminated

    @property
    def released(self) -> bool:
        """Its thinking ended and no grammar follows: nothing is left to mask (the scheduler drops it)."""
        return not self.thinking and self.inner is None

    def forced(self) -> int | None:
        """The token the budget forces next (the marker's next one), or None: once the tokens the request
        sampled while thinking (a marker it began and left included) reach the budget."""
        if self.thinking and 0 <= self.budget <= self.count - self.forced_n:
            return self.tokens.end_ids[self.matched]
        return None

    def catch_up(self, output_ids: list[int]) -> None:
        if self.stopped:
            return
        start, n, end = clock(), len(output_ids), self.tokens.end_ids
        try:
            while self.thinking and self.accepted < n:
                token = output_ids[self.accepted]
                forced = self.forced()
                if forced is not None and token != forced:
                    raise GrammarRejectedToken(f"token {token} at output position {self.accepted} (the budget forces {forced})")  # fmt: skip
                if forced is None and self.tokens.strict and token in self.tokens.excluded:
                    raise GrammarRejectedToken(f"token {token} at output position {self.accepted} (not while thinking)")  # fmt: skip
                self.accepted += 1
                self.count += 1
                self.forced_n += forced is not None
                self.tail = (self.tail + (token,))[-len(end) :]
                self.matched = next((k for k in range(len(self.tail), 0, -1) if self.tail[-k:] == end[:k]), 0)
                if self.matched == len(end):
                    self.thinking, self.think_len = False, self.accepted
        finally:
            self.spent += clock() - start
        if not self.thinking:
            if self.inner is None:
                self.accepted = n
            else:
                self.inner.catch_up(output_ids, self.think_len)
                self.accepted = self.think_len + self.inner.accepted

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.stopped:
            return
        if not self.thinking:
            if self.inner is not None:
                self.inner.fill(bitmask, row)
            return  # (no grammar after the reasoning: the row allows every token)
        forced = self.forced()
        if forced is not None:
            bitmask[row] = 0
            word, bit = divmod(forced, 32)
            bitmask[row, word] = _int32(1 << bit)
        elif self.tokens.strict:
            for token in self.tokens.excluded:
                word, bit = divmod(token, 32)
                bitmask[row, word] &= _int32(~(1 << bit))

    def take_spent(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent + (self.inner.take_spent() if self.inner is not None else 0.0)


def _int32(x: int) -> int:
    """`x`'s low 32 bits as a signed int32 (the bitmask's words)."""
    x &= 0xFFFFFFFF
    return x - (1 << 32) if x >= 1 << 31 else x
