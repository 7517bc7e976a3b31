"""The overlap schedule: real concurrency between the scheduler and the forward stream, and the race it
must be exact under (a checkpoint handed to the tree by a batch that is still running). On CPU the
forward stream runs on the scheduler thread by default; these tests give it its own thread, as on CUDA,
so that a batch can be held in flight."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from sglang.srt.environ import envs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=15, suite="per-commit-cpu")

PRESET = "tiny-qwen3-next"


@pytest.fixture(autouse=True)
def forward_stream_thread():
    with envs.SGLANG_CPU_FORWARD_THREAD.override(True):
        yield


def _wait_for(pred, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.005)
    return False


@pytest.mark.parametrize("overlap", [True, False])
def test_scheduler_runs_ahead_of_a_held_forward_stream(overlap, oracles):
    h = SchedulerHarness(
        PRESET, mamba_scheduler_strategy="extra_buffer", disable_overlap_schedule=not overlap
    )
    sched = h.sched
    sched.record_events = True
    held, release = 5, threading.Event()
    sched.worker.before_batch_hooks.append(lambda item: item.batch_id == held and release.wait(10))
    prompt = token_ids(60, seed=8)
    rid = h.submit(prompt, max_new_tokens=20)
    loop = threading.Thread(target=sched.run_until_idle)
    loop.start()
    try:
        ran_ahead = _wait_for(
            lambda: ("launch", held + 1) in sched.events and ("process", held - 1) in sched.events, 2.0
        )
        assert ("process", held) not in sched.events, "batch N is held on the forward stream"
        # With overlap the scheduler launched N+1 and processed N-1 while N was held; without, it
        # waits for N before doing anything else.
        assert ran_ahead == overlap
    finally:
        release.set()
        loop.join(30)
    h.collect()
    h.check_oracle(oracles[PRESET], prompt, h.outputs[rid])
    h.flush_and_check_empty()
    h.shutdown()


def _race(cow_on_scheduler_thread: bool, oracle) -> tuple[float, int]:
    """Request A (200 tokens) is chunk-prefilled in chunks of 128; its first chunk's snapshot at 128 is
    handed to the tree while that chunk is still running (the forward stream is slowed), and request B,
    admitted into the very next batch beside A's second chunk, hits it. Returns B's max |dlogprob|
    against the oracle and its cached tokens."""
    with (
        envs.SGLANG_TEST_FORWARD_DELAY_MS.override(150),
        envs.SGLANG_TEST_COW_ON_SCHEDULER_THREAD.override(cow_on_scheduler_thread),
    ):
        h = SchedulerHarness(PRESET, mamba_scheduler_strategy="extra_buffer", chunked_prefill_size=128)
        try:
            a = token_ids(200, seed=20)
            h.submit(a, max_new_tokens=4)
            assert h.sched.step()  # launches A's first chunk [0, 128), which snapshots at 128
            first = h.sched.in_flight[0][1]
            b = a[:150] + token_ids(20, seed=21)
            rid_b = h.submit(b, max_new_tokens=8)
            # Stash A (its snapshot slot goes to the tree), admit B with a hit there, launch both.
            batch = h.sched.get_next_batch_to_run()
            assert [r.rid for r in batch.reqs] == ["req-0", rid_b] and not first.done()
            h.sched.launch(batch)
            h.run()
            out = h.outputs[rid_b]
            ref = oracle.token_logprobs(b + out.output_ids, start=len(b))
            err = (torch.tensor(out.logprobs) - ref).abs().max().item()
            return err, out.cached_tokens
        finally:
            h.shutdown()


def test_hit_on_a_checkpoint_still_being_written_is_exact(oracles):
    err, cached = _race(False, oracles[PRESET])
    assert cached == 128
    assert err < 1e-4


def test_negative_control_state_ops_off_the_stream_read_a_stale_checkpoint(oracles):
    err, cached = _race(True, oracles[PRESET])
    assert cached == 128
    assert err > 1e-2, (
        f"copying on the scheduler thread should read the checkpoint before it is written ({err})"
    )
