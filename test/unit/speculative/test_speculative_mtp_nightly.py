"""Nightly (suite nightly-cpu) cases of `test_speculative_mtp.py`: greedy NEXTN outputs equal plain
decoding's on Qwen3.5 and Qwen3.5-MoE, with every strategy, under KV pressure (retractions) and with
the demo model's trained drafts.
Run: `python -m pytest -q test/unit/speculative/test_speculative_mtp_nightly.py`."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.mtp_checks import NEXTN, QWEN, assert_same, demo_outputs, held_out_prompts, plain_then_spec
from sglang.test.scheduler_harness import churn_harness, run_churn, token_ids

register_cpu_ci(est_time=200, suite="nightly-cpu")


@pytest.mark.parametrize(
    "preset,strategy",
    [
        (QWEN, "no_buffer"),
        (QWEN, "extra_buffer_lazy"),
        ("tiny-qwen3.5", "extra_buffer"),
        ("tiny-qwen3.5-moe", "no_buffer"),
    ],
)
def test_greedy_same_as_plain_decoding(monkeypatch, preset, strategy):
    prompts = [token_ids(70 + 29 * k, seed=10 + k) for k in range(3)]
    assert_same(*plain_then_spec(monkeypatch, preset, strategy, prompts, 30))


def test_retractions_keep_outputs():
    outs = {}
    for spec in (False, True):
        h = churn_harness(False, **(NEXTN if spec else {}))
        try:
            rids = run_churn(h, abort_at=10_000)
            assert h.sched.counters["num_retractions_total"] > 0
            h.sched.check_integrity()
            outs[spec] = [h.outputs[r].output_ids for r in rids]
            h.flush_and_check_empty()
        finally:
            h.shutdown()
    assert outs[True] == outs[False]


def test_demo_outputs_with_its_trained_drafts_are_plain_decodings():
    """The drafts the trained MTP layer proposes (no teacher), accepted or not, change no token."""
    prompts = held_out_prompts(4, 96)
    spec_out, stats = demo_outputs(prompts, speculative_algorithm="NEXTN", speculative_num_steps=3)
    assert stats["accepted_tokens"] > 0
    assert spec_out == demo_outputs(prompts)[0]
