"""A seeded random workload on small pools, per configuration: rounds of requests over shared prefixes
(cache hits of every depth, exact repeats, continuations), random lengths, some aborted mid-decode,
lazy allocation failures injected, a third of the requests with logit penalties (their output token
counts on the forward stream, through retraction, aborts and reused rows). After every round: each
request that was not aborted matches the oracle (with its penalties' rules), every aborted one ended
with an abort, and `check_integrity()` holds. Admission under pressure
(evictions, retractions, waiting for room) is exercised for real, with every strategy."""

from __future__ import annotations

import os
import random
import zlib

import pytest

from sglang.srt.environ import envs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, check_penalized_oracle, token_ids

register_cpu_ci(est_time=50, suite="per-commit-cpu")

QWEN, NEMO = "tiny-qwen3-next", "tiny-nemotron-h"
# (preset, strategy, page size, chunked prefill, lazy failure mode, overlap)
CONFIGS = [
    (QWEN, "extra_buffer_lazy", 1, None, 0, True),
    (QWEN, "extra_buffer_lazy", 16, 128, 1, True),
    (NEMO, "extra_buffer_lazy", 128, 256, 2, True),
    (QWEN, "extra_buffer", 128, None, 0, True),
    (NEMO, "extra_buffer", 1, 64, 0, False),
    (NEMO, "no_buffer", 1, None, 0, True),
    (QWEN, "no_buffer", 1, 128, 0, False),
]
ROUNDS, PER_ROUND = 3, 6
SEED = int(os.environ.get("SGLANG_TEST_WORKLOAD_SEED", "0"))  # vary it to explore more workloads


def _run_round(h: SchedulerHarness, rng: random.Random, prefixes: list[list[int]], history: list) -> None:
    sched = h.sched
    jobs = []
    for _ in range(PER_ROUND):
        kind = rng.random()
        if history and kind < 0.25:
            prompt = rng.choice(history)  # exact repeat
        elif history and kind < 0.45:
            prompt = rng.choice(history) + token_ids(rng.randint(1, 40), seed=rng.randrange(10**6))
        else:
            prompt = rng.choice(prefixes)[: rng.randint(20, 300)] + token_ids(
                rng.randint(1, 60), seed=rng.randrange(10**6)
            )
        n = rng.randint(1, 40)
        penalties = {}
        if rng.random() < 0.35:
            # A boosted token that the counts then push back down (penalties that never bite test nothing).
            penalties = {"logit_bias": {rng.randrange(512): 3.0}, "frequency_penalty": rng.choice([0.0, 0.8]),
                         "presence_penalty": rng.choice([0.0, 1.0]), "repetition_penalty": rng.choice([1.0, 1.5])}  # fmt: skip
        jobs.append((h.submit(prompt, max_new_tokens=n, **penalties), prompt, n, penalties))
    to_abort = {rid for rid, *_ in jobs if rng.random() < 0.2}
    for _ in range(rng.randint(2, 6)):
        sched.step()
    for rid in sorted(to_abort):
        sched.abort_request(rid)
    sched.run_until_idle()
    h.collect()
    for rid, prompt, n, penalties in jobs:
        out = h.outputs[rid]
        assert out.finished_reason is not None, rid
        if out.finished_reason["type"] == "abort":
            assert rid in to_abort, out.finished_reason
            continue
        assert len(out.output_ids) == n
        if penalties:
            check_penalized_oracle(h.oracle, prompt, out, **penalties)
        else:
            h.check_oracle(h.oracle, prompt, out)
        history.append(prompt + out.output_ids)
    sched.check_integrity()
    assert not sched.penalty_slots.in_use


@pytest.mark.parametrize("preset,strategy,page,chunk,fail_mode,overlap", CONFIGS, ids=lambda v: str(v))
def test_random_workload_on_small_pools(preset, strategy, page, chunk, fail_mode, overlap, oracles):
    _run_workload(oracles, preset, strategy, page, chunk, fail_mode, overlap)


# --enable-mixed-chunk: the running requests' decode steps ride in the prefill batches (mixed_chunk.py),
# through the same pressure: retractions, aborts, failed allocations (a step that cannot give every
# decode row its KV slot does not mix), penalties.
MIXED_CONFIGS = [
    (QWEN, "extra_buffer_lazy", 16, 64, 1, True),
    (NEMO, "extra_buffer", 1, 64, 0, False),
    (QWEN, "extra_buffer", 1, 64, 0, True),
    (NEMO, "no_buffer", 1, 64, 0, True),
]


@pytest.mark.parametrize("preset,strategy,page,chunk,fail_mode,overlap", MIXED_CONFIGS, ids=lambda v: str(v))
def test_random_workload_with_mixed_chunks(preset, strategy, page, chunk, fail_mode, overlap, oracles):
    mixed = _run_workload(oracles, preset, strategy, page, chunk, fail_mode, overlap, enable_mixed_chunk=True)
    assert mixed >= 3, f"only {mixed} batches mixed: the workload did not test mixing"


def _run_workload(oracles, preset, strategy, page, chunk, fail_mode, overlap, **flags) -> int:
    """Runs the rounds; returns how many batches mixed decode rows into a prefill."""
    resident = {"no_buffer": 1, "extra_buffer": 3 if overlap else 2, "extra_buffer_lazy": 1}[strategy]
    c = max({QWEN: 64, NEMO: 32}[preset], page)
    h = SchedulerHarness(
        preset,
        mamba_scheduler_strategy=strategy,
        page_size=page,
        chunked_prefill_size=chunk or -1,
        disable_overlap_schedule=not overlap,
        max_mamba_cache_size=4 * resident + 2,
        max_total_tokens=4096,
        max_running_requests=4,  # the pool, not the derived cap (which keeps tree headroom), limits
        mamba_track_interval=c,
        **flags,
    )
    h.oracle = oracles[preset]
    mixed = 0
    launch = h.sched.launch

    def count(batch) -> None:
        nonlocal mixed
        mixed += batch.forward_mode.is_extend() and batch.num_decode_rows > 0
        launch(batch)

    h.sched.launch = count
    rng = random.Random(zlib.crc32(repr((preset, strategy, page, chunk, fail_mode, SEED)).encode()))
    prefixes = [token_ids(300, seed=500 + k) for k in range(3)]
    history: list[list[int]] = []
    try:
        with envs.SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL.override(fail_mode):
            for _ in range(ROUNDS):
                _run_round(h, rng, prefixes, history)
        h.flush_and_check_empty()
    finally:
        h.shutdown()
    return mixed
