"""`PrefixCacheBranchingMixin`: three requests share a prefix of L = 230 tokens and branch after it.

Expected cached tokens, in order: [0, 0, ⌊L/C⌋·C] (C = the cache chunk size).
- The first request is cold. Its prefill checkpoint sits at ⌊(L + S)/C⌋·C, past the branching point
  (the suffix length S makes L + S reach 256, a multiple of every C used: 32, 64, 128).
- The second matches L tokens of KV but no checkpoint at or before the branching point, so it hits
  nothing; it records a snapshot at ⌊L/C⌋·C (the branching point, chunk-aligned).
- The third hits that snapshot.
L = 230 gives a different answer for each C (224, 192, 128), so a wrong chunk size is caught.
This holds with a chunked-prefill size and a track interval that put no checkpoint below L + S.
"""

from __future__ import annotations

from sglang.test.kits.common import KitRequests, prompt_ids


class PrefixCacheBranchingMixin(KitRequests):
    cache_chunk_size: int = 64
    branching_prefix_len: int = 230
    branching_suffix_len: int = 40
    branching_new_tokens: int = 4
    branching_seed: int = 4321

    def expected_branching_cached(self) -> list[int]:
        c = self.cache_chunk_size
        return [0, 0, self.branching_prefix_len // c * c]

    def test_prefix_cache_branching(self) -> None:
        prefix = prompt_ids(self.branching_prefix_len, self.branching_seed)
        self.flush_cache()
        cached = []
        for k in range(3):
            suffix = prompt_ids(self.branching_suffix_len, self.branching_seed + 1 + k)
            out = self.greedy(prefix + suffix, self.branching_new_tokens)
            cached.append(out.cached_tokens)
        print(f"[{type(self).__name__}] branching cached tokens {cached}")
        self.assertEqual(cached, self.expected_branching_cached())
