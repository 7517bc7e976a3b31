"""Nemotron-H (Mamba2) served with extra_buffer and extra_buffer_lazy: prefix-cache hits are exact.

The cache chunk comes from the config: Mamba2's `chunk_size` (32 in the tiny preset) at page size 1.
"""

from __future__ import annotations

from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.kits import KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=30, suite="per-commit-cpu")

MODEL = "tiny-nemotron-h"
# The config's Mamba2 chunk size is the cache chunk at page size 1 (read through the config adapter).
CHUNK = ServerArgs(model_path=MODEL, random_seed=0).mamba_cache_chunk_size


class _NemotronH(KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin):
    model = MODEL
    cache_chunk_size = CHUNK
    mamba_track_interval = CHUNK


class TestNemotronHExtraBuffer(_NemotronH, ServerTestCase):
    server_args = ["--mamba-scheduler-strategy", "extra_buffer", "--mamba-track-interval", str(CHUNK)]


class TestNemotronHExtraBufferLazy(_NemotronH, ServerTestCase):
    server_args = ["--mamba-scheduler-strategy", "extra_buffer_lazy", "--mamba-track-interval", str(CHUNK)]

    def test_chunk_from_config(self) -> None:
        self.assertEqual(CHUNK, 32, "the tiny preset's Mamba2 chunk_size is 32")
