"""Nightly (suite nightly-cpu) cases of `test_speculative_mtp.py`: greedy NEXTN outputs equal plain
decoding's on Qwen3.5 and Qwen3.5-MoE, with every strategy, under KV pressure (retractions) and with
the demo model's trained drafts; sampling batches through the greedy draft-loop graph bodies (greedy
requests still plain decoding's, a seeded request reproducible).
Run: `python -m pytest -q test/unit/speculative/test_speculative_mtp_nightly.py`."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.mtp_checks import NEXTN, QWEN, assert_same, demo_outputs, held_out_prompts, plain_then_spec
from sglang.test.scheduler_harness import SchedulerHarness, churn_harness, run_churn, token_ids

register_cpu_ci(est_time=206, suite="nightly-cpu")


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


def test_sampling_batches_replay_the_greedy_draft_graphs():
    """A NEXTN server with draft-loop graphs (their CPU bodies, one bucket of 4) serves plans with sampling
    requests from the same greedy graph (`MtpDraftGraphs.can_run`; before, a sampling request in the batch
    sent the whole loop to the eager path): every draft loop replays the graph while a sampling request
    drafts. Requests: two greedy, one seeded sampling request (it drafts, then finishes first) and one
    sampling request with a frequency penalty (never drafts), so the later verifies have greedy drafts
    only beside a sampling row. The greedy requests' tokens are plain decoding's; the seeded request's
    tokens are the same when the batch runs again after a flush (its acceptance and resample draws come
    from its seed; before, from the draft runner's generator, whose state has moved on: other tokens)."""
    prompts = [token_ids(20 + 5 * k, seed=k) for k in range(4)]
    params = [
        dict(max_new_tokens=10),
        dict(max_new_tokens=10),
        dict(max_new_tokens=7, temperature=1.0, top_k=20, sampling_seed=1234),
        dict(max_new_tokens=10, temperature=0.8, frequency_penalty=0.5),
    ]

    def batch(h):
        rids = [h.submit(p, return_logprob=False, **kw) for p, kw in zip(prompts, params, strict=True)]
        h.run()
        h.flush_and_check_empty()
        return [h.outputs[r].output_ids for r in rids]

    h = SchedulerHarness(QWEN, disable_overlap_schedule=True)
    try:
        plain = batch(h)
    finally:
        h.shutdown()
    h = SchedulerHarness(QWEN, disable_overlap_schedule=True, **NEXTN)
    try:
        h.use_graph_bodies([4])
        first, again = batch(h), batch(h)
        draft = h.sched.spec.draft
        loops, replays = draft.loops, draft.graphs.replays
    finally:
        h.shutdown()
    assert first[:2] == plain[:2] == again[:2]
    assert first[2] == again[2] and len(first[2]) == 7
    assert loops > 0 and replays == loops, (replays, loops)
