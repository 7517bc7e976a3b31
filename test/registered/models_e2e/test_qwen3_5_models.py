"""Qwen3.5 (dense MLPs) and Qwen3.5-MoE served through the HTTP server: greedy outputs match the
transformers oracle, and prefix-cache hits are exact (KL against a cold prefill, branching prefixes).

Qwen3.5-MoE runs the mission's `extra_buffer_lazy` at page size 16 (track interval 64, the cache
chunk); Qwen3.5 runs `extra_buffer` with the track interval at twice the cache chunk.
"""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.kits import KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=45, suite="per-commit-cpu")


class TestQwen3_5MoeLazyExtraBuffer(
    KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin, ServerTestCase
):
    model = "tiny-qwen3.5-moe"
    page_size = 16
    server_args = [
        "--mamba-scheduler-strategy", "extra_buffer_lazy", "--page-size", "16", "--mamba-track-interval", "64"
    ]

    def test_accounting_after_workload(self) -> None:
        self.greedy([5, 6, 7, 8] * 20, 8)
        self.assert_idle_accounting()


class TestQwen3_5ExtraBuffer(KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin, ServerTestCase):
    model = "tiny-qwen3.5"
    mamba_track_interval = 128
    server_args = ["--mamba-scheduler-strategy", "extra_buffer", "--mamba-track-interval", "128"]
