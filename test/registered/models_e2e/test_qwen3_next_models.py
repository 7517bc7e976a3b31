"""Qwen3-Next (Gated DeltaNet) served with extra_buffer_lazy: prefix-cache hits are exact.

Each class starts a real server. GDN's kernel state chunk is 64; with --page-size 128 the cache chunk
(128) differs from it, which is the case upstream got wrong. The allocation-failure variants make the
first try of every lazy track-slot allocation fail (SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL=1): the
evict-and-retry path runs for real and every hit must stay exact. The negative control skips the
deferred copy-on-write of a hit's checkpoint, and the KL check must then fail.
"""

from __future__ import annotations

import unittest

from sglang.test.ci_register import full_matrix, register_cpu_ci
from sglang.test.kits import KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=62, suite="per-commit-cpu")

LAZY = ["--mamba-scheduler-strategy", "extra_buffer_lazy"]


class _Qwen3NextLazy(KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin):
    model = "tiny-qwen3-next"
    cache_chunk_size = 64
    mamba_track_interval = 64
    server_args = [*LAZY, "--mamba-track-interval", "64"]


class TestQwen3NextLazyExtraBuffer(_Qwen3NextLazy, ServerTestCase):
    def test_accounting_after_workload(self) -> None:
        self.greedy([5, 6, 7, 8] * 20, 8)
        self.assert_idle_accounting()


class TestQwen3NextLazyExtraBufferLargePage(_Qwen3NextLazy, ServerTestCase):
    cache_chunk_size = 128
    mamba_track_interval = 128
    page_size = 128
    server_args = [*LAZY, "--page-size", "128", "--mamba-track-interval", "128"]


class _AllocFail:
    env = {"SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL": "1"}
    # Outputs are unaffected by where snapshots go; the oracle match runs in the classes above.
    test_reference_match = None

    def test_lazy_alloc_failures_counted(self) -> None:
        self.flush_cache()
        self.greedy(list(range(3, 3 + 100)), 2 * self.mamba_track_interval)
        state = self.assert_idle_accounting()
        self.assertGreater(state["lazy_alloc_failures"]["first_try"], 0, state["lazy_alloc_failures"])


class TestQwen3NextLazyExtraBufferAllocFail(_AllocFail, TestQwen3NextLazyExtraBuffer):
    pass


# (Per commit the allocation failures at page 16 and the large page without them; both together in the
# nightly full matrix: test/registered/test_full_matrix_nightly.py.)
@unittest.skipUnless(full_matrix(), "the large page's allocation failures: in the nightly full matrix")
class TestQwen3NextLazyExtraBufferLargePageAllocFail(_AllocFail, TestQwen3NextLazyExtraBufferLargePage):
    pass


class TestQwen3NextSkipDeferredCowNegativeControl(KLDivergenceMixin, ServerTestCase):
    """Without the copy of the checkpoint into the running slot, a hit must not match a cold prefill."""

    model = "tiny-qwen3-next"
    server_args = [*LAZY, "--mamba-track-interval", "64"]
    env = {"SGLANG_TEST_SKIP_DEFERRED_COW": "1"}
    test_kl_prefill_hit = None
    test_kl_decode_seeded_hit = None
    test_kl_decode_boundary_hit = None

    def test_kl_fails_without_deferred_cow(self) -> None:
        stats = self.kl_prefill_hit_stats()
        print(f"[negative control] {stats}")
        self.assertTrue(all(c > 0 for c in stats.cached), f"the control must still hit: {stats}")
        self.assertGreater(stats.max_abs_diff, self.max_logprob_diff_thres, str(stats))
