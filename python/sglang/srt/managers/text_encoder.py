"""Tokenization that never blocks the TokenizerManager's event loop.

A request's texts are tokenized on the loop when they are short together (a few milliseconds at most),
else all of them go to a worker process in one call:
a fast tokenizer holds the GIL for much of a long text (a 10 MB prompt kept the loop of the HTTP
process, and every other request on it, waiting for 9-14 s), so a thread would not do. The worker
returns the ids only of a text within `limit` tokens; for a longer one it returns the count, and it
stops early when a prefix of the text alone is already far beyond the limit.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.backend_health import BackendDeadError

# A request's texts, up to this many characters in all, are tokenized on the loop.
INLINE_MAX_CHARS = 16_384
# The early check tokenizes a prefix of this many characters per allowed token...
PROBE_CHARS_PER_TOKEN = 8
# ...and a text is over the limit when that prefix alone exceeds it by this margin (the cut can split
# a word or a special token into a few more pieces than the whole text has there).
PROBE_MARGIN_TOKENS = 64


@dataclass
class Encoded:
    """`ids` is None when the text is longer than the limit; `num_tokens` is then its length, or a
    lower bound of it when `at_least`."""

    ids: list[int] | None
    num_tokens: int
    at_least: bool = False


class TextEncoder:
    def __init__(self, tokenizer: Any, tokenizer_path: str):
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self._pool: ProcessPoolExecutor | None = None

    async def encode(self, text: str, limit: int, add_special_tokens: bool = True, truncate: bool = False) -> Encoded:
        return (await self.encode_many([text], limit, add_special_tokens, truncate))[0]

    async def encode_many(
        self, texts: list[str], limit: int, add_special_tokens: bool = True, truncate: bool = False
    ) -> list[Encoded]:
        """`truncate` (--allow-auto-truncate): a text over `limit` gives its first `limit` ids (and its
        length, or a lower bound of it) instead of none."""
        if sum(len(t) for t in texts) <= INLINE_MAX_CHARS:
            return encode_texts(self.tokenizer, texts, limit, add_special_tokens, truncate)
        if self._pool is None:
            # Started on first use: most servers never see a long prompt.
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=mp.get_context("spawn"),
                initializer=_init_worker,
                initargs=(self.tokenizer_path,),
            )
        loop = asyncio.get_running_loop()
        try:
            out = await loop.run_in_executor(
                self._pool, _encode_in_worker, texts, limit, add_special_tokens, truncate
            )
        except BrokenProcessPool:
            self._pool = None  # the next long text starts a fresh worker
            raise BackendDeadError("The tokenizer worker process exited; retry the request.") from None
        return [Encoded(*r) for r in out]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None


def encode_texts(
    tokenizer: Any, texts: list[str], limit: int, add_special_tokens: bool = True, truncate: bool = False
) -> list[Encoded]:
    """`texts` tokenized on this thread, as the worker does it."""
    return [Encoded(*_encode(tokenizer, t, limit, add_special_tokens, truncate)) for t in texts]


_worker_tokenizer: Any = None


def _init_worker(tokenizer_path: str) -> None:
    global _worker_tokenizer
    from sglang.srt.utils.child_process import exit_with_parent
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    # Started by the thread that runs the TokenizerManager's loop, which outlives every use of it.
    exit_with_parent("tokenizer worker")
    # Bulk work: the scheduler and the HTTP loop come first when cores are scarce.
    os.nice(10)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _worker_tokenizer = get_tokenizer(tokenizer_path)


def _encode_in_worker(
    texts: list[str], limit: int, add_special_tokens: bool, truncate: bool = False
) -> list[tuple[list[int] | None, int, bool]]:
    return [_encode(_worker_tokenizer, t, limit, add_special_tokens, truncate) for t in texts]


def _encode(
    tok: Any, text: str, limit: int, add_special_tokens: bool, truncate: bool = False
) -> tuple[list[int] | None, int, bool]:
    """(ids, or None if over `limit` (`truncate`: the first `limit` of them), token count or a lower bound
    of it, whether it is a lower bound). A long text's probe prefix is tokenized alone first; when it
    already holds more than `limit` + PROBE_MARGIN_TOKENS tokens, the whole text is never tokenized (its
    first `limit` ids are the prefix's: the cut, at a space, is that margin past them)."""
    probe = limit * PROBE_CHARS_PER_TOKEN
    if len(text) > 2 * probe:
        cut = text.rfind(" ", probe // 2, probe)
        head = tok.encode(text[: cut if cut > 0 else probe], add_special_tokens=truncate and add_special_tokens)
        n = len(head)
        if n > limit + PROBE_MARGIN_TOKENS:
            return (head[:limit] if truncate else None), n - PROBE_MARGIN_TOKENS, True
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    if len(ids) > limit:
        return (ids[:limit] if truncate else None), len(ids), False
    return ids, len(ids), False
