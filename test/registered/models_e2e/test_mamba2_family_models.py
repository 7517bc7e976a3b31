"""Granite-4.0-H (Mamba2, MoE with a shared MLP, the config's multipliers) served with extra_buffer_lazy,
and Bamba with extra_buffer at page size 16: greedy outputs match the transformers oracle and
prefix-cache hits are exact.

The cache chunk comes from the config: `mamba_chunk_size` (32 in both tiny presets).
"""

from __future__ import annotations

from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.kits import KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=30, suite="per-commit-cpu")

MODEL = "tiny-granite-4.0-h"
CHUNK = ServerArgs(model_path=MODEL, random_seed=0).mamba_cache_chunk_size
BAMBA_CHUNK = ServerArgs(model_path="tiny-bamba", page_size=16, random_seed=0).mamba_cache_chunk_size


class TestGraniteMoeHybridLazyExtraBuffer(
    KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin, ServerTestCase
):
    model = MODEL
    cache_chunk_size = CHUNK
    mamba_track_interval = CHUNK
    server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy", "--mamba-track-interval", str(CHUNK)]

    def test_chunk_from_config(self) -> None:
        self.assertEqual(CHUNK, 32, "the tiny preset's mamba_chunk_size is 32")

    def test_accounting_after_workload(self) -> None:
        self.greedy([5, 6, 7, 8] * 20, 8)
        self.assert_idle_accounting()


class TestBambaExtraBuffer(KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin, ServerTestCase):
    model = "tiny-bamba"
    page_size = 16
    cache_chunk_size = mamba_track_interval = BAMBA_CHUNK
    server_args = ["--mamba-scheduler-strategy", "extra_buffer", "--page-size", "16"]
    server_args += ["--mamba-track-interval", str(BAMBA_CHUNK)]
