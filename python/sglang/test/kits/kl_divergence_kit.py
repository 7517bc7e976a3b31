"""`KLDivergenceMixin`: a prefix-cache hit must give the logprobs of a cold prefill of the same tokens.

Three kinds of hit, prompts built from token ids:
- prefill hit: flush, populate the prefix (max_new_tokens=0), generate prefix + suffix greedily;
- decode-seeded hit: flush, turn 1 generates from a prompt, turn 2 sends turn 1's prompt + output + more,
  hitting turn 1's final state (or, where that is not inserted, a checkpoint written while it decoded);
- decode-boundary hit: the same, but turn 2 leaves turn 1's output 10 tokens before its end, past its last
  decode track boundary: it hits the snapshot written at that boundary.
Each hit's output logprobs are compared with a cold prefill (after a flush) of prompt + output with
logprob_start_len=0, whose input logprobs at the output positions are the teacher-forced values.
Reported: mean KL (k3 estimator, exp(d) - 1 - d with d = cold - hit, per token) and max |Δlogprob|.

Every prompt must hit (unless SGLANG_TEST_SKIP_CACHE_HIT_ASSERT=1), with exactly the cached_tokens the
strategy's rules predict (`expected_prefill_hit`, `expected_decode_seeded_hit`,
`expected_decode_boundary_hit`).
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
    page_size: int = 1
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

    def _final_state_inserted(self, kv_len: int) -> bool:
        # A finished request's final state goes into the tree where its KV ends on a page.
        return self.mamba_strategy == "no_buffer" or kv_len % self.page_size == 0

    def _prompt_snapshot(self, prompt_len: int) -> int:
        return prompt_len // self.cache_chunk_size * self.cache_chunk_size

    def expected_prefill_hit(self, prefix_len: int) -> int:
        # The populating request's KV is the prefix; its prefill snapshot sits at the last chunk in it.
        return prefix_len if self._final_state_inserted(prefix_len) else self._prompt_snapshot(prefix_len)

    def _last_boundary(self, prompt_len: int, turn1_new_tokens: int, shared: int) -> int:
        """What turn 2 hits through turn 1's checkpoints other than its final state, sharing `shared`
        tokens with it: the prompt's snapshot, or turn 1's newest decode snapshot (the only one it
        inserts) if turn 2 reaches it."""
        # Turn 1 ran prompt + n - 1 tokens through the model (its last token was never fed back).
        computed = prompt_len + turn1_new_tokens - 1
        if self.mamba_strategy == "no_buffer":
            return 0
        newest = computed // self.mamba_track_interval * self.mamba_track_interval
        return max(self._prompt_snapshot(prompt_len), newest if newest <= shared else 0)

    def expected_decode_seeded_hit(self, prompt_len: int, turn1_new_tokens: int) -> int:
        computed = prompt_len + turn1_new_tokens - 1
        if self._final_state_inserted(computed):
            return computed
        return self._last_boundary(prompt_len, turn1_new_tokens, computed)

    def expected_decode_boundary_hit(self, prompt_len: int, turn1_new_tokens: int, leave_early: int) -> int:
        return self._last_boundary(prompt_len, turn1_new_tokens, prompt_len + turn1_new_tokens - leave_early)

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

    def kl_decode_seeded_stats(self, leave_early: int = 0) -> KLStats:
        """Turn 2 continues turn 1's output but for its last `leave_early` tokens."""
        kls, diffs, cached, expected, n = [], [], [], [], 0
        for k, length in enumerate(self.kl_decode_prompt_lens):
            prompt1 = prompt_ids(length, self.kl_seed + 200 + k)
            self.flush_cache()
            turn1 = self.greedy(prompt1, self.kl_turn1_new_tokens)
            kept = turn1.output_ids[: len(turn1.output_ids) - leave_early]
            prompt2 = prompt1 + kept + prompt_ids(self.kl_suffix_len, self.kl_seed + 300 + k)
            hit = self.greedy(prompt2, self.kl_new_tokens)
            cached.append(hit.cached_tokens)
            if leave_early:
                expected.append(
                    self.expected_decode_boundary_hit(length, self.kl_turn1_new_tokens, leave_early)
                )
            else:
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

    def test_kl_decode_boundary_hit(self) -> None:
        # 10 tokens short of turn 1's end: past its last boundary with the defaults (100 + 39 fed
        # tokens, boundaries every 32, 64 or 128: the last at 128). A `no_buffer` server has no decode
        # snapshots: a subclass for one sets this test to None.
        self.assert_kl_stats(self.kl_decode_seeded_stats(leave_early=10), "decode-boundary hit")
