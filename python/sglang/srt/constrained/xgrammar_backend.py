"""`--grammar-backend xgrammar`: the scheduler compiles each request's grammar against the model's vocabulary
and keeps one matcher per request.

`GrammarBackend.submit` parses and compiles on threads of its own (xgrammar's compiler releases the
GIL; `compile_pool.py`: one that times out gives its place up), so a large schema does not stall the
batches running meanwhile; compiled grammars are cached by
xgrammar (the same schema twice compiles once; the cache is bounded). `RequestGrammar` follows the
request's output: `catch_up` feeds the matcher the output tokens it has not seen (each exactly once,
whoever calls first: the finish check after a step, or the mask of the next batch), `fill` writes the
tokens allowed next as a row of bits (`vocab_mask.py`).

The matcher's stop tokens are the model's end-of-sequence ids (config, generation config, tokenizer):
a grammar completes on one of them, as the request does.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future
from typing import Any

import torch

from sglang.srt.constrained.compile_pool import CompilePool
from sglang.srt.constrained.grammar_spec import ANY_JSON, structural_tag_grammar
from sglang.srt.constrained.output_check_budget import clock

logger = logging.getLogger(__name__)

# xgrammar's cache of compiled grammars (by kind and text): bounded, as every distinct schema a client
# sends would otherwise stay for the life of the process.
COMPILE_CACHE_BYTES = 512 << 20


class GrammarRejectedToken(RuntimeError):
    """A sampled token that the grammar does not allow (the mask should have made it impossible)."""


class RequestGrammar:
    """One request's matcher, how many of its output tokens it has accepted, and the scheduler thread's
    time its accepts and fills took since the finish check last took it (`take_spent`)."""

    __slots__ = ("matcher", "vocab_size", "accepted", "terminated", "spent", "stopped")
    released = False  # (never: a reasoning grammar's is when its thinking ends with nothing after it)

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size  # the logits' width, which the masks cover
        self.accepted = 0
        self.terminated = False
        self.spent = 0.0
        # Ended for its cost (`OutputCheckBudget`) at its next finish check: it fills no mask meanwhile.
        self.stopped = False

    def catch_up(self, output_ids: list[int], offset: int = 0) -> None:
        """Accept the output tokens after the last accepted one (the grammar's output begins at `offset`:
        after the reasoning, `reasoning_grammar.py`); raises GrammarRejectedToken."""
        if self.stopped or offset + self.accepted >= len(output_ids):
            return
        matcher, start = self.matcher, clock()
        try:
            for token in output_ids[offset + self.accepted :]:
                if self.terminated or not matcher.accept_token(token):
                    raise GrammarRejectedToken(f"token {token} at output position {offset + self.accepted}")
                self.accepted += 1
                self.terminated = matcher.is_terminated()
        finally:
            self.spent += clock() - start

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self.stopped:
            return  # (the row allows every token: the request ends at its check, whatever it samples)
        start = clock()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self.spent += clock() - start

    def take_spent(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


class GrammarBackend:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        any_whitespace: bool = True,
        compile_threads: int = 2,
    ):
        import xgrammar as xgr

        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids) or None
        )
        # The compiler's own threads (the mask cache of one grammar); `compile_threads` grammars at once,
        # so that one slow grammar does not hold up every other.
        self.compiler = xgr.GrammarCompiler(info, max_threads=2, cache_limit_bytes=COMPILE_CACHE_BYTES)
        self.any_whitespace = any_whitespace
        self.pool = CompilePool(compile_threads)

    def submit(self, kind: str, text: str) -> Future:
        """The compiled grammar of (`kind`, `text`), compiled on the backend's thread."""
        return self.pool.submit(self.compile, kind, text)

    def abandon(self, fut: Future) -> None:
        """Nobody waits for `fut` any more (its request timed out or left): a queued compile is dropped,
        a running one gives its place in the pool up."""
        if not fut.cancel():
            self.pool.abandon(fut)

    def compile(self, kind: str, text: str) -> Any:
        compiler = self.compiler
        if kind == "json_schema":
            if text == ANY_JSON:
                return compiler.compile_builtin_json_grammar()
            return compiler.compile_json_schema(json.loads(text), any_whitespace=self.any_whitespace)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text)
        return structural_tag_grammar(text, compiler)

    def matcher(self, compiled: Any) -> RequestGrammar:
        import xgrammar as xgr

        return RequestGrammar(xgr.GrammarMatcher(compiled), self.vocab_size)

    def shutdown(self) -> None:
        self.pool.shutdown()


def create_grammar_backend(
    server_args: Any, tokenizer: Any, vocab_size: int, eos_ids: set[int]
) -> tuple[GrammarBackend | None, str]:
    """The backend `--grammar-backend` names, or None and why there is none (what a request with a
    grammar is told)."""
    if server_args.grammar_backend == "none":
        return None, "this server runs without constrained decoding (--grammar-backend none)"
    if tokenizer is None:
        return None, "this server holds no tokenizer to match a grammar with (--skip-tokenizer-init)"
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        logger.warning("xgrammar is not installed: requests with a grammar get a 400 (pip install xgrammar).")
        return None, "xgrammar is not installed on this server (pip install xgrammar)"
    backend = GrammarBackend(
        tokenizer,
        vocab_size,
        list(eos_ids),
        any_whitespace=not server_args.constrained_json_disable_any_whitespace,
    )
    return backend, ""
