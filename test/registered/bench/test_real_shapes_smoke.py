"""The real-shape benchmark end to end on a CPU (`benchmark/gpu/bench_real_shapes.py`): the slice maker
writes each of the three slices (tiny widths, the real layer patterns), the model runner decodes and
prefills them, and the rows and tables carry what the GPU run reports, with the extrapolation's
arithmetic; and the dry run's accounting at the real shapes (no weights) gives the facts file's numbers
for the Qwen3-Next-80B slice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=135, suite="nightly-cpu")

GPU_BENCH = Path(__file__).resolve().parents[3] / "benchmark" / "gpu"


def _run(*args: str) -> tuple[list[dict], str]:
    proc = subprocess.run(
        [sys.executable, str(GPU_BENCH / "bench_real_shapes.py"), *args],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    return rows, proc.stdout


def test_tiny_slices_run_and_report_every_row(tmp_path):
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    rows, stdout = _run(
        "--device", "cpu", "--tiny", "--steps", "2", "--reps", "1", "--ckpt-dir", str(ckpt), "--out", str(out)
    )
    assert json.loads((out / "real_shapes.json").read_text()) == rows
    layers = {"qwen3-next-80b": (4, 48), "nemotron-h-8b": (13, 52), "qwen3.5-35b-a3b": (4, 40)}
    assert [r["model"] for r in rows if r["kind"] == "slice"] == list(layers)
    for name, (cut, full) in layers.items():
        mine = [r for r in rows if r["model"] == name]
        assert (mine[0]["slice_layers"], mine[0]["full_layers"]) == (cut, full)
        decode = [r for r in mine if r["kind"] == "decode"]
        assert [r["batch"] for r in decode] == [1, 8]
        for r in decode:
            assert r["step_ms"] > 0 and r["floor_ms"] > 0 and r["step0_ms"] > 0
            assert r["share"] == pytest.approx(r["floor_ms"] / r["step_ms"], rel=2e-3)  # 4 significant digits
            # The full model: the step's fixed part (the step without layers) once, the per-layer part
            # (step - fixed) / slice layers at full depth. (rel 2e-3: 4 significant digits of each.)
            expected = r["step0_ms"] + (r["step_ms"] - r["step0_ms"]) / cut * full
            assert r["full_step_ms"] == pytest.approx(expected, rel=2e-3)
            assert r["full_floor_ms"] > r["floor_ms"]
            assert r["floor_gb"]["total"] == pytest.approx(
                sum(r["floor_gb"][k] for k in ("weights", "experts", "state", "kv")), rel=2e-3
            )
        prefill = [r for r in mine if r["kind"] == "prefill"]
        assert [r["tokens"] for r in prefill] == [256, 2304]
        assert all(r["chunk"] == 2048 for r in prefill)  # the CPU server's chunk: 2,304 ran in two
        for r in prefill:
            assert r["tok_s"] > 0 and r["tflops"] > 0
            assert r["full_seconds"] == pytest.approx(r["seconds"] * full / cut, rel=2e-3)
        assert f"### {name}: slice" in stdout
    # The written slices keep the layer patterns (transformers' own config names for them).
    nemo = json.loads((ckpt / "nemotron-h-8b-tiny" / "config.json").read_text())
    kinds = nemo["layers_block_type"]
    assert len(kinds) == 13 and kinds.count("full_attention") == 1 and kinds.count("mlp") == 6
    qwen = json.loads((ckpt / "qwen3-next-80b-tiny" / "config.json").read_text())
    assert qwen["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    assert qwen["full_attention_interval"] == 4


def test_dry_run_accounts_the_real_80b_slice():
    """At the real shapes (meta device): 7.21B parameters (the facts file's slice), 10 / 367 / 509
    experts per layer at batch 1 / 64 / 256, and the weights' floor 0.24 ms at batch 1 at 4.8 TB/s."""
    rows, stdout = _run("--dry-run", "--models", "qwen3-next-80b,nemotron-h-8b")
    (qwen,) = [r for r in rows if r["kind"] == "slice" and r["model"] == "qwen3-next-80b"]
    assert qwen["params"] == pytest.approx(7.21e9, rel=1e-3) and qwen["bandwidth_tbs"] == 4.8
    decode = {r["batch"]: r for r in rows if r["kind"] == "decode" and r["model"] == "qwen3-next-80b"}
    assert [decode[b]["experts_touched"] for b in (1, 64, 256)] == [10.0, 367.1, 508.7]
    assert decode[1]["floor_ms"] == pytest.approx(0.245, abs=0.005)
    assert "step_ms" not in decode[1]
    nemo = [r for r in rows if r["model"] == "nemotron-h-8b"]
    assert nemo[0]["params"] == pytest.approx(2.83e9, rel=1e-2)
    skipped = [r for r in nemo if r["kind"] == "prefill" and "skipped" in r]
    assert [r["tokens"] for r in skipped] == [32768]  # past Nemotron-H-8B-Base-8K's 8,192 positions


def test_run_gpu_checks_plans_the_real_shape_steps(tmp_path):
    """`run_gpu_checks.sh real_80b real_35b real_nemotron` under GPU_DRY_RUN: each step's limit fits the
    deadline, and each command's arguments parse (run here with --dry-run: the floors at real shapes)."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "GPU_DRY_RUN": "1", "GPU_DEADLINE_S": "570"}
    proc = subprocess.run(
        ["bash", str(GPU_BENCH / "run_gpu_checks.sh"), "real_80b", "real_35b", "real_nemotron"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    plan = [line for line in (out / "summary.txt").read_text().splitlines() if line.startswith("bench ")]
    assert [line.split(":")[0] for line in plan] == ["bench real_80b", "bench real_35b", "bench real_nemotron"]
    limits = [int(line.split("would run ")[1].split(" s")[0]) for line in plan]
    assert sum(limits) <= 570 and limits[0] <= 200  # the 80B step: ~3 minutes
    root = GPU_BENCH.parents[1]
    for line in plan:
        cmd = line.split(" s: ", 1)[1].split()
        assert cmd[:2] == ["python3", "benchmark/gpu/bench_real_shapes.py"]
        done = subprocess.run(
            [sys.executable, *cmd[1:], "--dry-run"], cwd=root, capture_output=True, text=True, timeout=300
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert sum(1 for x in done.stdout.splitlines() if x.startswith('{"model"')) == 7  # slice, 4 + 2 rows


def test_run_gpu_checks_says_why_warm_start_80b_did_not_run(tmp_path):
    """Without the 80B slice `warm_start_80b` says "skipped (no slice...)" in the summary (it was left
    out silently); the dry run shows it with that condition, and `warm_start`'s 147M checkpoint is written
    inside its step (its limit and the deadline), not before it."""
    script = str(GPU_BENCH / "run_gpu_checks.sh")

    def summary(env: dict, *steps: str) -> list[str]:
        out = tmp_path / "out"
        env = {**os.environ, "OUT": str(out), **env}
        subprocess.run(["bash", script, *steps], cwd=tmp_path, env=env, capture_output=True, timeout=120)
        lines = (out / "summary.txt").read_text().splitlines()
        (out / "summary.txt").unlink()
        return [line for line in lines if line.startswith("bench ")]

    (skipped,) = summary({}, "warm_start_80b")
    assert skipped.startswith("bench warm_start_80b: skipped (no slice")
    plan = summary({"GPU_DRY_RUN": "1"}, "warm_start", "warm_start_80b")
    assert plan[0].startswith("bench warm_start: would run 150 s: bash -c [ -f /tmp/sglang-bench-147m/config")
    assert "write_checkpoint" in plan[0] and plan[0].endswith("--device cuda --dtype bfloat16")
    assert plan[1].startswith("bench warm_start_80b: would run 200 s:")
    assert plan[2].startswith("bench warm_start_80b: (skipped unless real_80b has written")


def test_without_layers_recaptures_the_graph_bodies_and_puts_the_layers_back(tmp_path):
    """The GPU path of the decode intercept on the CPU: the runner's graph runner in its eager form
    (`use_graphs=False`, the same capture and replay bodies): without its 4 layers a decode step is
    cheaper (measured 24 vs 356 ms at batch 8), and after it the layers are back: a step costs again
    what it did (bounds of 2x either way: the loaded VM's noise; the two differ 15x)."""
    sys.path.insert(0, str(GPU_BENCH))
    import bench_real_shapes as brs
    import real_shapes as rs

    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    path = rs.ensure_slice("qwen3-next-80b", str(tmp_path), device="cpu", tiny=True)
    runner = brs._runner(path, "cpu", "float32", 8, 8 * 200)
    runner.graph_runner = CudaGraphRunner(runner, [1, 8], use_graphs=False)
    with_layers = brs.measure_decode(runner, "cpu", 8, 3, 32, 2048)
    with brs.without_layers(runner, 4):
        without = brs.measure_decode(runner, "cpu", 8, 3, 32, 2048)
    again = brs.measure_decode(runner, "cpu", 8, 3, 32, 2048)
    assert without < with_layers / 2 and again > 2 * without, (with_layers, without, again)


def test_the_verify_rows_time_a_verify_against_the_decode_step(tmp_path):
    """--verify-width (issue 57): a verify of that many positions at the batches up to 16, its row
    beside the decode step of the same batch, and the table's verify section."""
    rows, stdout = _run(
        "--device", "cpu", "--tiny", "--models", "qwen3-next-80b", "--batches", "1,2,32", "--prefill", "256",
        "--steps", "2", "--reps", "1", "--verify-width", "3", "--ckpt-dir", str(tmp_path),
    )  # fmt: skip
    decode = {r["batch"]: r["step_ms"] for r in rows if r["kind"] == "decode"}
    verify = [r for r in rows if r["kind"] == "verify"]
    assert [r["batch"] for r in verify] == [1, 2]  # (32: over issue 57's batches)
    for r in verify:
        assert r["width"] == 3 and r["verify_ms"] > 0 and r["decode_ms"] == decode[r["batch"]]
        assert r["graph"] is False  # (CPU: no captured graphs)
        assert r["verify_over_decode"] == pytest.approx(r["verify_ms"] / r["decode_ms"], rel=2e-3)
    assert "| verify batch | positions |" in stdout
