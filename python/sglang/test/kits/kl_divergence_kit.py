"""`KLDivergenceMixin`: a prefix-cache hit must give the logprobs of a cold prefill of the same tokens.

Two kinds of hit, prompts built from token ids:
- prefill hit: flush, populate the prefix (max_new_tokens=0), generate prefix + suffix greedily;
- decode-seeded hit: flush, turn 1 generates from a prompt, turn 2 sends turn 1's prompt + output + more,
  hitting a checkpoint written while turn 1 decoded.
Each hit's output logprobs are compared with a cold prefill (after a flush) of prompt + output with
logprob_start_len=0, whose input logprobs at the output positions are the teacher-forced values.
Reported: mean KL (k3 estimator, exp(d) - 1 - d with d = cold - hit, per token) and max |Δlogprob|.

Every prompt must hit (unless SGLANG_TEST_SKIP_CACHE_HIT_ASSERT=1), with exactly the cached_tokens the
strategy's rules predict (`expected_prefill_hit`, `expected_decode_seeded_hit`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sglang.srt.environ import envs
from sglang.test.kits.common import KitRequests, prompt_ids


@dataclass
class KLStats:
    kl: float
    max_abs_diff: float
    num_tokens: int
    cached: list[int]
    expected_cached: list[int]

    def __str__(self) -> str:
        return (
            f"KL(k3)={self.kl:.3e} max|dlogprob|={self.max_abs_diff:.3e} over {self.num_tokens} tokens; "
            f"cached {self.cached} (expected {self.expected_cached})"
        )


def kl_k3(hit: list[float], cold: list[float]) -> tuple[float, float]:
    diffs = [c - h for h, c in zip(hit, cold, strict=True)]
    kl = sum(math.exp(d) - 1 - d for d in diffs) / max(len(diffs), 1)
    return kl, max((abs(d) for d in diffs), default=0.0)


class KLDivergenceMixin(KitRequests):
    # The server's cache chunk C (max(kernel chunk, page size)) and decode track interval I.
    cache_chunk_size: int = 64
    mamba_track_interval: int = 64
    mamba_strategy: str = "extra_buffer"  # "no_buffer" changes the predicted hits
    kl_div_thres: float = 1e-8
    max_logprob_diff_thres: float = 1e-4
    # Long enough to hit with a cache chunk of 128 (page size 128).
    kl_prefix_lens: tuple[int, ...] = (150, 230)
    kl_suffix_len: int = 8
    kl_new_tokens: int = 16
    kl_decode_prompt_lens: tuple[int, ...] = (100,)
    kl_turn1_new_tokens: int = 40
    kl_seed: int = 1234

    # ---- predictions -------------------------------------------------------------------------------

    def expected_prefill_hit(self, prefix_len: int) -> int:
        if self.mamba_strategy == "no_buffer":
            return prefix_len
        return prefix_len // self.cache_chunk_size * self.cache_chunk_size

    def expected_decode_seeded_hit(self, prompt_len: int, turn1_new_tokens: int) -> int:
        # Turn 1 ran prompt + n - 1 tokens through the model (its last token was never fed back).
        computed = prompt_len + turn1_new_tokens - 1
        if self.mamba_strategy == "no_buffer":
            return computed
        interval = self.mamba_track_interval
        return max(self.expected_prefill_hit(prompt_len), computed // interval * interval)

    # ---- measurements ------------------------------------------------------------------------------

    def _compare(self, prompt: list[int], hit_ids: list[int], hit_lps: list[float]) -> tuple[float, float]:
        cold = self.cold_input_logprobs(prompt + hit_ids)[len(prompt) :]
        return kl_k3(hit_lps, cold)

    def kl_prefill_hit_stats(self) -> KLStats:
        kls, diffs, cached, expected, n = [], [], [], [], 0
        for k, length in enumerate(self.kl_prefix_lens):
            prefix = prompt_ids(length, self.kl_seed + k)
            prompt = prefix + prompt_ids(self.kl_suffix_len, self.kl_seed + 100 + k)
            self.flush_cache()
            self.populate(prefix)
            hit = self.greedy(prompt, self.kl_new_tokens)
            cached.append(hit.cached_tokens)
            expected.append(self.expected_prefill_hit(length))
            kl, diff = self._compare(prompt, hit.output_ids, hit.logprobs)
            kls.append(kl * len(hit.logprobs))
            diffs.append(diff)
            n += len(hit.logprobs)
        return KLStats(sum(kls) / max(n, 1), max(diffs), n, cached, expected)

    def kl_decode_seeded_stats(self) -> KLStats:
        kls, diffs, cached, expected, n = [], [], [], [], 0
        for k, length in enumerate(self.kl_decode_prompt_lens):
            prompt1 = prompt_ids(length, self.kl_seed + 200 + k)
            self.flush_cache()
            turn1 = self.greedy(prompt1, self.kl_turn1_new_tokens)
            prompt2 = prompt1 + turn1.output_ids + prompt_ids(self.kl_suffix_len, self.kl_seed + 300 + k)
            hit = self.greedy(prompt2, self.kl_new_tokens)
            cached.append(hit.cached_tokens)
            expected.append(self.expected_decode_seeded_hit(length, self.kl_turn1_new_tokens))
            kl, diff = self._compare(prompt2, hit.output_ids, hit.logprobs)
            kls.append(kl * len(hit.logprobs))
            diffs.append(diff)
            n += len(hit.logprobs)
        return KLStats(sum(kls) / max(n, 1), max(diffs), n, cached, expected)

    def assert_kl_stats(self, stats: KLStats, what: str) -> None:
        print(f"[{type(self).__name__}] {what}: {stats}")
        if not envs.SGLANG_TEST_SKIP_CACHE_HIT_ASSERT.get():
            self.assertTrue(all(c > 0 for c in stats.cached), f"{what}: a prompt missed the cache: {stats}")
            self.assertEqual(stats.cached, stats.expected_cached, f"{what}: cached_tokens: {stats}")
        self.assertLessEqual(stats.max_abs_diff, self.max_logprob_diff_thres, f"{what}: {stats}")
        self.assertLessEqual(stats.kl, self.kl_div_thres, f"{what}: {stats}")

    # ---- tests -------------------------------------------------------------------------------------

    def test_kl_prefill_hit(self) -> None:
        self.assert_kl_stats(self.kl_prefill_hit_stats(), "prefill hit")

    def test_kl_decode_seeded_hit(self) -> None:
        self.assert_kl_stats(self.kl_decode_seeded_stats(), "decode-seeded hit")
