"""LFM2 (short convs, whose state is their conv window, and attention) served with extra_buffer_lazy at
page size 16, and LFM2-MoE with extra_buffer: greedy outputs match the transformers oracle and
prefix-cache hits are exact (the snapshots are conv windows; upstream serves LFM2 without extra
buffers)."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.kits import KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=25, suite="per-commit-cpu")


class TestLfm2LazyExtraBuffer(
    KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin, ServerTestCase
):
    model = "tiny-lfm2"
    page_size = 16
    server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy", "--page-size", "16"]
    server_args += ["--mamba-track-interval", "64"]

    def test_accounting_after_workload(self) -> None:
        self.greedy([5, 6, 7, 8] * 20, 8)
        self.assert_idle_accounting()


class TestLfm2MoeExtraBuffer(KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin, ServerTestCase):
    model = "tiny-lfm2-moe"
    server_args = ["--mamba-scheduler-strategy", "extra_buffer", "--mamba-track-interval", "64"]
