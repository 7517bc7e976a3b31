"""Helpers shared by the kits: deterministic prompts from token ids, and greedy requests with logprobs."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

# Ids 0..2 are the tiny presets' special tokens (<|endoftext|>, <|im_start|>, <|im_end|>); prompts
# avoid them so that no prompt holds an end-of-sequence marker.
FIRST_ORDINARY_ID = 3


def prompt_ids(length: int, seed: int, vocab_size: int = 512) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(FIRST_ORDINARY_ID, vocab_size) for _ in range(length)]


@dataclass
class GreedyResult:
    output_ids: list[int]
    logprobs: list[float]
    cached_tokens: int
    raw: dict[str, Any]


class KitRequests:
    """Mixed into a ServerTestCase; the kits reach the server through these."""

    def greedy(self, ids: list[int], max_new_tokens: int, **extra: Any) -> GreedyResult:
        out = self.generate(
            input_ids=ids,
            sampling_params={"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
            return_logprob=True,
            **extra,
        )
        meta = out["meta_info"]
        return GreedyResult(
            out["output_ids"], [e[0] for e in meta["output_token_logprobs"]], meta["cached_tokens"], out
        )

    def populate(self, ids: list[int]) -> dict[str, Any]:
        """Prefill only (max_new_tokens=0): the prompt's state goes into the cache."""
        return self.generate(input_ids=ids, sampling_params={"max_new_tokens": 0})

    def cold_input_logprobs(self, ids: list[int]) -> list[float | None]:
        """Teacher-forced logprob of every position of `ids` from an empty cache (entry 0 is None)."""
        self.flush_cache()
        out = self.generate(
            input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=0
        )
        meta = out["meta_info"]
        assert meta["cached_tokens"] == 0, f"a cold prefill hit the cache: {meta['cached_tokens']}"
        entries = meta["input_token_logprobs"]
        assert len(entries) == len(ids), f"{len(entries)} input logprobs for {len(ids)} tokens"
        assert [e[1] for e in entries] == ids, "input logprobs are not of the prompt's tokens"
        return [e[0] for e in entries]
