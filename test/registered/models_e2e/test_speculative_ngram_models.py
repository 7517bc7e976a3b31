"""NGRAM speculative decoding served end to end (`--speculative-algorithm NGRAM`), for Gated DeltaNet and
Mamba2: the kits' oracle match, exact prefix hits (prefill, seeded decode, track boundary) and branching,
with verify steps doing the decoding; and a repeated prompt, whose drafts are the first run's tokens,
comes back unchanged while /get_server_info and /metrics show the accepted drafts (upstream's
`avg_spec_accept_length` and `sglang:spec_accept_length`).
"""

from __future__ import annotations

import unittest

from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import full_matrix, register_cpu_ci
from sglang.test.kits import KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin
from sglang.test.kits.common import prompt_ids
from sglang.test.test_utils import ServerTestCase

register_cpu_ci(est_time=25, suite="per-commit-cpu")

NGRAM = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8", "--enable-metrics"]


class _Ngram(KLDivergenceMixin, PrefixCacheBranchingMixin, ReferenceMatchMixin):
    def test_repeated_prompt_accepts_drafts_and_keeps_its_tokens(self) -> None:
        prompt = prompt_ids(60, seed=9)
        first = self.greedy(prompt, 64)
        again = self.greedy(prompt, 64)
        self.assertEqual(again.output_ids, first.output_ids)
        for a, b in zip(first.logprobs, again.logprobs, strict=True):
            self.assertAlmostEqual(a, b, delta=1e-4)  # the decode and verify paths agree to ~1e-6
        state = self.get("/get_server_info").json()["internal_states"][0]
        # The second run commits up to 8 tokens per verify: the average over both runs is well above 1.
        self.assertGreater(state["avg_spec_accept_length"], 1.5, state["speculative"])
        gauge = [x for x in self.get("/metrics").text.splitlines() if x.startswith("sglang:spec_accept_length{")]
        self.assertEqual(len(gauge), 1, gauge)
        self.assertGreater(float(gauge[0].rsplit(" ", 1)[1]), 1.5)
        # Upstream's per-request fields: the second run's 63 tokens after its first came in fewer forwards.
        meta = again.raw["meta_info"]
        verifies, accepted = meta["spec_verify_ct"], meta["spec_num_correct_drafts"]
        self.assertEqual(verifies + accepted, 63)  # each forward: one token plus the drafts it accepted
        self.assertGreater(accepted, 20, meta)
        self.assertEqual(sum(meta["spec_accept_histogram"]), verifies)
        self.assertEqual(sum(k * n for k, n in enumerate(meta["spec_accept_histogram"])), accepted)
        self.assertAlmostEqual(meta["spec_accept_length"], 64 / verifies)
        self.assertLessEqual(accepted, meta["spec_num_proposed_drafts"])
        self.assertAlmostEqual(meta["spec_accept_rate"], accepted / meta["spec_num_proposed_drafts"])


class TestQwen3NextNgram(_Ngram, ServerTestCase):
    model = "tiny-qwen3-next"
    cache_chunk_size = 64
    mamba_track_interval = 64
    server_args = [*NGRAM, "--mamba-track-interval", "64"]


# Per commit NGRAM on Nemotron-H (lazy, Mamba2) runs in the scheduler's tests (test_speculative_ngram.py's
# CONFIGS); its server here in the nightly full matrix (test/registered/test_full_matrix_nightly.py).
@unittest.skipUnless(full_matrix(), "Nemotron-H's NGRAM server: in the nightly full matrix")
class TestNemotronHNgramLazy(_Ngram, ServerTestCase):
    model = "tiny-nemotron-h"
    cache_chunk_size = ServerArgs(model_path=model, random_seed=0).mamba_cache_chunk_size
    mamba_track_interval = cache_chunk_size
    server_args = [*NGRAM, "--mamba-scheduler-strategy", "extra_buffer_lazy", "--mamba-track-interval", "32"]
