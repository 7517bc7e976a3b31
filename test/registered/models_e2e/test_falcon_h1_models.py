"""Falcon-H1 (Mamba2 and attention side by side in every layer, muP multipliers) served with
extra_buffer_lazy at page size 16: greedy outputs match the transformers oracle and prefix-cache hits
are exact, with every layer's KV and state cached together.

The cache chunk comes from the config: `mamba_chunk_size` (32 in the tiny preset), which page size 16
divides.
"""

from __future__ import annotations

from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.kits import KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=20, suite="per-commit-cpu")

MODEL = "tiny-falcon-h1"
CHUNK = ServerArgs(model_path=MODEL, page_size=16, random_seed=0).mamba_cache_chunk_size


class TestFalconH1LazyExtraBuffer(
    KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin, ServerTestCase
):
    model = MODEL
    page_size = 16
    cache_chunk_size = CHUNK
    mamba_track_interval = CHUNK
    server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy", "--page-size", "16"]
    server_args += ["--mamba-track-interval", str(CHUNK)]

    def test_chunk_from_config(self) -> None:
        self.assertEqual(CHUNK, 32, "the tiny preset's mamba_chunk_size is 32")

    def test_accounting_after_workload(self) -> None:
        self.greedy([5, 6, 7, 8] * 20, 8)
        self.assert_idle_accounting()
