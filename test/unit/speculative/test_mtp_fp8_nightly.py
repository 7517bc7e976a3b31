"""NEXTN on an FP8 checkpoint (tiny-qwen3-next-fp8, the MTP layer dequantized at load on the CPU;
the per-commit file is test_mtp_fp8.py): the FP8 MTP layer's own drafts (no teacher) leave the committed
tokens plain decoding's on the same checkpoint. Nightly: two scheduler runs, 7 s measured (18 s under load)."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=15, suite="nightly-cpu")

FP8 = "tiny-qwen3-next-fp8"
NEXTN = dict(speculative_algorithm="NEXTN")


def test_nextn_greedy_equals_plain_decoding_on_fp8():
    """The FP8 MTP layer's own drafts (no teacher): the committed tokens are plain decoding's."""
    outs = []
    for spec in ({}, NEXTN):
        h = SchedulerHarness(FP8, disable_overlap_schedule=True, **spec)
        try:
            rids = [
                h.submit(token_ids(40 + 11 * k, seed=k), max_new_tokens=12, return_logprob=False)
                for k in range(2)
            ]
            h.run()
            outs.append([h.outputs[r].output_ids for r in rids])
            if spec:
                stats = dict(h.sched.spec.stats)
            h.flush_and_check_empty()
        finally:
            h.shutdown()
    assert outs[0] == outs[1]
    assert stats["verify_steps"] > 0, stats
