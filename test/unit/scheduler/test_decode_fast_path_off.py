"""The decode fast path (`DecodeFastPath`: the decode set's certificates, the rows cache, the KV and token
logs) changes no output: with SGLANG_TEST_DISABLE_DECODE_FAST_PATH a churning workload (finishes by
length, stop ids and context length, an abort, retractions), with and without overlap, serves exactly
what it serves with the fast path on, while nothing is ever pending in the logs; and representative
scheduler tests of each boundary where the decode lists are read pass with the fast path off too (a
subprocess, so the switch holds for every scheduler they build). The nightly-cpu file
test_scheduler_fast_path_off_nightly.py runs every scheduler file that way."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.srt.environ import envs
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import churn_harness, token_ids

register_cpu_ci(est_time=47, suite="per-commit-cpu")

HERE = Path(__file__).resolve().parent
# Scheduler-level tests whose assertions hold either way (the fast path's own tests, which count its
# logged steps, are not among them), a cheap one per boundary where the decode lists are read: request
# semantics (streaming, aborts, retraction, a prefix cache hit, stop strings), overlap, a lazy decode
# snapshot taken by the tree, the PD decode side, speculative verifies between logged steps. The server
# tests are not run twice (CI time).
FILES_RUN_BOTH_WAYS = [
    "test_request_semantics.py",
    "test_overlap.py::test_scheduler_runs_ahead_of_a_held_forward_stream[True]",
    "test_prompt_checkpoints.py::test_prompt_checkpoint_survives_a_decode_boundary[extra_buffer_lazy]",
    "test_speculative_ngram.py::test_steps_without_logprobs_finish_on_time",
    "../disaggregation/test_decode_queue.py",
]


def _churn(overlap: bool, steps_pending: list[int]) -> tuple[list, int]:
    """`run_churn`'s workload, stepping by hand to see the logs after every step."""
    h = churn_harness(overlap, context_length=120)
    try:
        rids = []
        for k in range(14):
            stops = {"stop_token_ids": list(range(3, 12))} if k % 3 == 0 else {}
            rids.append(
                h.submit(
                    token_ids(10 + 7 * k, seed=k), max_new_tokens=20 + 9 * k, return_logprob=False, **stops
                )
            )
        sched = h.sched
        for step in range(400):
            if step == 40:
                sched.abort_request(rids[5])
            if not sched.step():
                break
            steps_pending.append(len(sched.fast_path.kv_log.pending) + len(sched.fast_path.token_log.pending))
        h.collect()
        outputs = [(h.outputs[r].output_ids, h.outputs[r].finished_reason) for r in rids]
        retractions = sched.counters["num_retractions_total"]
        h.flush_and_check_empty()
    finally:
        h.shutdown()
    return outputs, retractions


@pytest.mark.parametrize("overlap", [True, False])
def test_the_fast_path_changes_no_output(overlap):
    on_pending: list[int] = []
    with_fast_path, retractions = _churn(overlap, on_pending)
    assert max(on_pending) > 0, "the workload must leave steps pending in the logs with the fast path on"
    assert retractions > 0
    assert {r["type"] for _, r in with_fast_path} == {"length", "stop", "abort"}
    off_pending: list[int] = []
    with envs.SGLANG_TEST_DISABLE_DECODE_FAST_PATH.override(True):
        without, _ = _churn(overlap, off_pending)
    assert max(off_pending) == 0, "with the fast path off nothing is ever pending"
    assert without == with_fast_path


def test_scheduler_files_pass_with_the_fast_path_off():
    env = dict(os.environ, SGLANG_TEST_DISABLE_DECODE_FAST_PATH="1")
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *FILES_RUN_BOTH_WAYS]
    run = subprocess.run(cmd, cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
