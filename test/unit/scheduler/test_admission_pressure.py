"""Admission under pool pressure: the node a waiting request matched must survive the eviction that
admission itself runs to make room (for KV pages, for mamba slots), or the request would lock a freed
node and copy from a freed checkpoint. The scheduler must neither crash nor deadlock: a request that
does not fit waits, and when nothing else runs it is admitted without its hit rather than never.
"""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=30, suite="per-commit-cpu")

PRESET = "tiny-qwen3-next"  # cache chunk 64
STRATEGIES = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]

# Slots a running request holds between boundaries (MambaStrategy.resident_slots_per_req, overlap
# on): since b07989c a lazy request holds only its running slot.
RESIDENT = {"no_buffer": 1, "extra_buffer": 3, "extra_buffer_lazy": 1}


def _drive_until(h: SchedulerHarness, rid: str, steps: int = 4) -> None:
    """Run a few steps so that `rid` is admitted and decoding (the "long request running")."""
    for _ in range(steps):
        h.sched.step()
    assert any(r.rid == rid for r in h.sched.running), "the long request must be running"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_slot_pressure_keeps_the_matched_checkpoint(strategy, oracles):
    """Mamba pool of 4 slots: prompt A is cached, a long request holds its resident slots, then
    A + 64 tokens arrives. Its COW slot takes the last free slot; the track slots it still needs may
    not be found by evicting A's checkpoint, the very source of its copy. (Lazy has no track slots:
    its pool of 3 is full once the COW is taken, measured, and the hit must still hold.)"""
    h = SchedulerHarness(
        PRESET,
        mamba_scheduler_strategy=strategy,
        max_mamba_cache_size=RESIDENT[strategy] + 2,
        max_total_tokens=4096,
        max_running_requests=4,
    )
    oracle = oracles[PRESET]
    try:
        a = token_ids(192, seed=1)
        h.generate(a, max_new_tokens=1)
        long_prompt = token_ids(100, seed=2)
        long_rid = h.submit(long_prompt, max_new_tokens=40)
        _drive_until(h, long_rid)
        prompt = a + token_ids(64, seed=3)
        rid = h.submit(prompt, max_new_tokens=6)
        h.run()
        h.check_oracle(oracle, long_prompt, h.outputs[long_rid])
        out = h.outputs[rid]
        h.check_oracle(oracle, prompt, out)
        assert out.finished_reason == {"type": "length", "length": 6}
        h.sched.check_integrity()
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_kv_pressure_keeps_the_matched_prefix(strategy, oracles):
    """KV pool of 4096 tokens: A (1,000 tokens) is cached, a long request fills most of the rest, then
    A + 64 tokens arrives: the pages its extend needs may not come from evicting A's own prefix."""
    h = SchedulerHarness(
        PRESET, mamba_scheduler_strategy=strategy, max_total_tokens=4096, max_running_requests=4
    )
    oracle = oracles[PRESET]
    try:
        a = token_ids(1000, seed=4)
        h.generate(a, max_new_tokens=1)
        long_prompt = token_ids(3050, seed=5)
        long_rid = h.submit(long_prompt, max_new_tokens=8)
        _drive_until(h, long_rid)
        prompt = a + token_ids(64, seed=6)
        rid = h.submit(prompt, max_new_tokens=4)
        h.run()
        h.check_oracle(oracle, long_prompt, h.outputs[long_rid])
        out = h.outputs[rid]
        h.check_oracle(oracle, prompt, out)
        assert out.finished_reason == {"type": "length", "length": 4}
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("strategy", ["extra_buffer", "extra_buffer_lazy"])
def test_a_hit_that_cannot_fit_alone_is_admitted_cold(strategy, oracles):
    """A pool of exactly one request's resident slots: a hit would need the checkpoint besides them
    (extra_buffer: a COW slot and two track slots; lazy: a COW slot). With nothing else running,
    waiting cannot help: the request runs without its hit. (Before b07989c lazy held two slots per
    request and this ran lazy at two slots; at two it now fits, so the premise needs one.)"""
    h = SchedulerHarness(
        PRESET,
        mamba_scheduler_strategy=strategy,
        max_mamba_cache_size=RESIDENT[strategy],
        max_running_requests=1,
    )
    try:
        a = token_ids(130, seed=7)
        h.generate(a, max_new_tokens=1)
        assert h.sched.tree_cache.held_mamba_slots(), "A left a checkpoint"
        prompt = a + token_ids(10, seed=8)
        out = h.generate(prompt, max_new_tokens=3)
        h.check_oracle(oracles[PRESET], prompt, out)
        assert out.cached_tokens == 0
        h.flush_and_check_empty()
    finally:
        h.shutdown()
