"""The per-commit files' full matrices (suite nightly-cpu, not run by CI):
    python -m pytest -q test/registered/test_full_matrix_nightly.py

Some per-commit files run a case per path and leave out the cases that repeat a path on another preset
(`ci_register.per_commit_cases`, or a skip naming this file): here they run whole, in a subprocess with
SGLANG_TEST_FULL_MATRIX=1 (Nemotron-H's PD pair through the protocol tests, its NGRAM verifies in the
graph's shape and through the CUDA kernels interpreted; Falcon-H1's CUDA-default kernels; the demo model's
training run twice, bit for bit, and its shipped weights' held-out loss; Nemotron-H's NGRAM server; the
engine-vs-HF bench script's and the norms' census's CPU checks; Nemotron-H's padded graph replay and its
CUDA-default kernels through the engine; Qwen3-Next's large page with allocation failures; the bounded
load under extra_buffer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.test.ci_register import FULL_MATRIX_ENV, register_cpu_ci

register_cpu_ci(est_time=500, suite="nightly-cpu")

TEST_ROOT = Path(__file__).resolve().parents[1]
FILES = [
    "registered/disaggregation/test_pd_router.py",
    "unit/scheduler/test_speculative_ngram.py",
    "unit/scheduler/test_cuda_path_on_cpu.py",
    "registered/models_e2e/test_demo_model.py",
    "registered/models_e2e/test_speculative_ngram_models.py",
    "registered/bench/test_gpu_bench_scripts.py",
    "unit/model/test_cuda_graph_runner.py",
    "registered/models_e2e/test_qwen3_next_models.py",
    "registered/test_bounded_pool_load.py",
]


@pytest.mark.parametrize("path", FILES)
def test_the_full_matrix_passes(path):
    env = {**os.environ, FULL_MATRIX_ENV: "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(TEST_ROOT / path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=TEST_ROOT.parent)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "nightly full matrix" not in proc.stdout, "a case was still left out"  # (the skips' reason)
