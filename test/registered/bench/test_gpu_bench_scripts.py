"""The GPU benchmark scripts keep working between the rare sessions that have a GPU (a script that
crashes there wastes minutes of a 15-minute lease): each runs its CPU check and prints the rows its
README describes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=45, suite="per-commit-cpu")

GPU_BENCH = Path(__file__).resolve().parents[3] / "benchmark" / "gpu"


def _rows(script: str, *args: str) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(GPU_BENCH / script), "--device", "cpu", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_bench_decode_step_prints_the_breakdown_per_batch():
    rows = _rows("bench_decode_step.py", "--small", "--steps", "2")
    assert [r["batch"] for r in rows] == [1, 4]
    for r in rows:
        assert r["wall_ms"] > 0 and set(r) >= {"gpu_kernel_ms", "launches", "host_syncs", "cuda_graphs"}


def test_bench_engine_vs_hf_prints_the_ratio():
    (row,) = _rows("bench_engine_vs_hf.py", "--small", "--reps", "1")
    assert row["engine_tok_per_s"] > 0 and row["hf_tok_per_s"] > 0 and row["engine_over_hf"] > 0
    # The run split by the scheduler's loop: 4 prompts x 8 new tokens, the first from the prefill.
    split = row["engine_loop_seconds_last_run"]
    assert split["prefill_batches"] >= 1 and split["decode_batches"] >= 7
    assert all(split[k] >= 0 for k in ("idle", "intake", "build", "launch", "wait", "process", "forward"))
    assert 0 < split["forward"] <= split["launch"] + 1e-3  # the CPU forward runs inside the launch


def test_bench_kernels_prints_every_kernel_row():
    rows = _rows("bench_kernels.py", "--tiny", "--reps", "1")
    kernels = [r["kernel"] for r in rows]
    assert [k.split()[0:2] for k in kernels] == [
        ["GDN", "prefill"], ["GDN", "decode"], ["GDN", "decode"], ["Mamba2", "decode"], ["Mamba2", "decode"],
        ["attention", "decode"],
    ]  # fmt: skip
    assert all(all(ms > 0 for ms in r["ms"].values()) for r in rows)


def test_run_gpu_checks_brings_back_the_autotune_results(tmp_path):
    """The device script hands Triton's autotuning results (and nothing else of its cache) back under
    $OUT as one tarball (the device tool returns at most 8 files, 2 folders down), where the next GPU
    session picks them up; run here with no step, no wheels and no GPU."""
    cache = tmp_path / "work" / ".gpu-cache" / "triton"
    (cache / "abc123").mkdir(parents=True)
    (cache / "abc123" / "chunk_fwd_kernel.autotune.json").write_text('{"configs_timings": []}')
    (cache / "abc123" / "chunk_fwd_kernel.cubin").write_bytes(b"\0" * 64)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", str(GPU_BENCH / "run_gpu_checks.sh"), "none"],
        cwd=tmp_path / "work", env={**os.environ, "OUT": str(out)}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert saved == ["gpu-cache.tar", "summary.txt"]
    with tarfile.open(out / "gpu-cache.tar") as tar:
        assert [m.name for m in tar.getmembers() if m.isfile()] == ["./abc123/chunk_fwd_kernel.autotune.json"]
    assert "autotune results saved: 1" in (out / "summary.txt").read_text()


def _census(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, str(GPU_BENCH / "kernel_census.py"), "--model", "tiny-nemotron-h", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[0])


def test_kernel_census_counts_what_the_triton_norm_saves():
    """The census of a decode step (meta device, CUDA's default kernels) counts every kernel: with the
    norms' Triton kernel (the CUDA default) the step runs fewer than with their torch form."""
    fused, torch_form = _census(), _census("--env", "SGLANG_GPU_NORM_BACKEND=torch")
    assert fused["triton"] > torch_form["triton"] > 0  # the decode steps' kernels, plus one per norm
    assert 0 < fused["kernels"] < torch_form["kernels"]
