"""The engine against the transformers oracle with each CPU state-copy implementation forced: decode
track copies (extra_buffer_lazy, overlap), no_buffer snapshot copies of a chunked request, and the COW
and clear of every prefix hit all go through the forced op."""

from __future__ import annotations

import pytest

from sglang.srt.environ import envs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=15, suite="per-commit-cpu")


def _harness(impl: str, preset: str, **kw) -> SchedulerHarness:
    with envs.SGLANG_MAMBA_STATE_COPY_BACKEND.override(impl):
        h = SchedulerHarness(preset, **kw)
    assert h.sched.req_to_token_pool.mamba_pool.state_copier.impl == impl
    return h


@pytest.mark.parametrize("impl", ["torch", "cpp"])
def test_decode_track_copies_and_cow(impl, oracles):
    # C = 64 (GDN chunk, page 16), track interval 64: turn 1 feeds 100 + 39 tokens, so the decode
    # step at position 128 snapshots through the track copy and turn 2 hits exactly there.
    h = _harness(
        impl,
        "tiny-qwen3-next",
        mamba_scheduler_strategy="extra_buffer_lazy",
        page_size=16,
        mamba_track_interval=64,
    )
    oracle = oracles["tiny-qwen3-next"]
    try:
        prompt = token_ids(100, seed=2)
        out = h.generate(prompt, max_new_tokens=40)
        h.check_oracle(oracle, prompt, out)
        turn2 = prompt + out.output_ids + token_ids(5, seed=3)
        out2 = h.generate(turn2, max_new_tokens=6)
        h.check_oracle(oracle, turn2, out2)
        assert out2.cached_tokens == 128
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("impl", ["torch", "cpp"])
def test_no_buffer_snapshot_copies_and_cow(impl, oracles):
    # Chunked prefill of 64: caching the unfinished request copies its state after 64 tokens into a
    # fresh slot; a second prompt sharing those 64 tokens starts from a COW of that copy.
    h = _harness(
        impl,
        "tiny-nemotron-h",
        mamba_scheduler_strategy="no_buffer",
        disable_overlap_schedule=True,
        chunked_prefill_size=64,
    )
    oracle = oracles["tiny-nemotron-h"]
    try:
        first = token_ids(100, seed=5)
        h.check_oracle(oracle, first, h.generate(first, max_new_tokens=3))
        second = first[:64] + token_ids(30, seed=6)
        out = h.generate(second, max_new_tokens=4)
        h.check_oracle(oracle, second, out)
        assert out.cached_tokens == 64
        h.flush_and_check_empty()
    finally:
        h.shutdown()
