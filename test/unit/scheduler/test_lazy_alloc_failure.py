"""extra_buffer_lazy when no slot can be had for a decode snapshot at a track boundary.

SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL=1: each boundary's first try fails, so evict-and-retry runs for real
(it evicts one checkpoint, then succeeds). =2: the retry fails too; the snapshot is then skipped and
the request runs on. Outputs stay exact either way; hits follow the rules.
"""

from __future__ import annotations

import pytest

from sglang.srt.environ import envs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=15, suite="per-commit-cpu")

PRESET = "tiny-nemotron-h"  # cache chunk 32: interval 32 puts many boundaries in a short decode
P1, N, INTERVAL = 100, 75, 32
BOUNDARIES = len(
    range((P1 // INTERVAL + 1) * INTERVAL, P1 + N, INTERVAL)
)  # decode steps ending on a multiple of INTERVAL: 128, 160


def _run(mode: int, chunk: int | None, oracles) -> tuple[SchedulerHarness, int, int]:
    """Cache 3 unrelated checkpoints, then turn 1 with failures injected, then turn 2; returns the
    harness, turn 2's cached tokens and how many unrelated checkpoints are left."""
    oracle = oracles[PRESET]
    h = SchedulerHarness(
        PRESET,
        mamba_scheduler_strategy="extra_buffer_lazy",
        mamba_track_interval=INTERVAL,
        chunked_prefill_size=chunk or -1,
    )
    for k in range(3):
        h.generate(token_ids(32, seed=70 + k), max_new_tokens=1)
    unrelated = len(h.sched.tree_cache.held_mamba_slots())
    prompt = token_ids(P1, seed=5)
    with envs.SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL.override(mode):
        out = h.generate(prompt, max_new_tokens=N)
    h.check_oracle(oracle, prompt, out)
    assert unrelated == 3
    # The unrelated prompts (32 tokens) left one checkpoint each, at 32: their prefill snapshot is their
    # final state.
    left = sum(1 for n in h.sched.tree_cache.nodes() if n.mamba_value is not None and n.path_len() == 32)
    # Turn 2 leaves turn 1's answer 10 tokens before its end: past the last boundary (160), short of
    # turn 1's final state (a checkpoint at 174 whatever the boundaries did), so it hits the track
    # snapshot if turn 1 inserted one.
    turn2 = prompt + out.output_ids[: N - 10] + [11, 12]
    out2 = h.generate(turn2, max_new_tokens=4)
    h.check_oracle(oracle, turn2, out2)
    return h, out2.cached_tokens, left


def test_first_try_failure_evicts_and_retries(oracles):
    h, hit, left = _run(1, None, oracles)
    try:
        failures = h.sched.get_internal_state()["lazy_alloc_failures"]
        assert failures == {"first_try": BOUNDARIES, "retry": 0}
        assert left == 3 - BOUNDARIES, "each failed first try evicted one checkpoint"
        assert hit == (P1 + N - 10) // INTERVAL * INTERVAL, (
            "the retry got the slot: decode-seeded hits still happen"
        )
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("chunk", [None, 64])
def test_total_failure_skips_the_snapshot(chunk, oracles):
    h, hit, _ = _run(2, chunk, oracles)
    try:
        failures = h.sched.get_internal_state()["lazy_alloc_failures"]
        assert failures == {"first_try": BOUNDARIES, "retry": BOUNDARIES}
        # Every boundary's snapshot was skipped: the tree has turn 1's settled final state (past turn 2's
        # divergence) and what its prefill handed over when it was scheduled: the prompt's checkpoint at
        # 96 (and the chunk end at 64). Turn 2 hits 96.
        assert hit == P1 // INTERVAL * INTERVAL
        h.flush_and_check_empty()
    finally:
        h.shutdown()
