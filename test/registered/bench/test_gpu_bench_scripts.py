"""The GPU benchmark scripts keep working between the rare sessions that have a GPU (a script that
crashes there wastes minutes of a 15-minute lease): each runs its CPU check and prints the rows its
README describes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
import torch

from sglang.test.ci_register import full_matrix, register_cpu_ci

register_cpu_ci(est_time=30, suite="per-commit-cpu")

# (The engine-vs-HF script's CPU check and the norms' census: in the nightly full matrix,
# test/registered/test_full_matrix_nightly.py; the census's eager launches are checked per commit below.)
nightly = pytest.mark.skipif(not full_matrix(), reason="a bench script's CPU check: in the nightly full matrix")

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


@nightly
def test_bench_engine_vs_hf_prints_the_ratio():
    (row,) = _rows("bench_engine_vs_hf.py", "--small", "--reps", "1")
    assert row["engine_tok_per_s"] > 0 and row["hf_tok_per_s"] > 0 and row["engine_over_hf"] > 0
    # The run split by the scheduler's loop: 4 prompts x 8 new tokens, the first from the prefill.
    split = row["engine_loop_seconds_last_run"]
    assert split["prefill_batches"] >= 1 and split["decode_batches"] >= 7
    assert all(split[k] >= 0 for k in ("idle", "intake", "build", "launch", "wait", "process", "forward"))
    assert 0 < split["forward"] <= split["launch"] + 1e-3  # the CPU forward runs inside the launch


def test_bench_kernels_prints_every_kernel_row():
    """Every kernel's row, then `--sweep`'s: each decode configuration once per kernel (GDN's in both
    forms of its output), the defaults marked once per kernel."""
    rows = _rows("bench_kernels.py", "--tiny", "--reps", "1", "--sweep")
    main, sweep = [r for r in rows if "config" not in r], [r for r in rows if "config" in r]
    assert [r["kernel"].split()[0:2] for r in main] == [
        ["GDN", "prefill"], ["GDN", "decode"], ["GDN", "decode"], ["Mamba2", "decode"], ["Mamba2", "decode"],
        ["attention", "decode"],
    ]  # fmt: skip
    assert all(all(ms > 0 for ms in r["ms"].values()) for r in rows)
    assert all(r["ms_with_launch"].keys() == r["ms"].keys() for r in rows)
    gdn = [r["config"] for r in sweep if r["kernel"].startswith("GDN")]
    mamba2 = [r["config"] for r in sweep if r["kernel"].startswith("Mamba2")]
    assert len(gdn) == 2 * len(mamba2) > 0 and {c["fused_out"] for c in gdn} == {False, True}
    assert sum(c["default"] for c in gdn) == 1 and sum(c["default"] for c in mamba2) == 1
    assert next(c for c in gdn if c["default"])["fused_out"] is False


def test_bench_kernels_changes_the_order_of_its_cases():
    """The round robin runs its cases in a fresh order each repetition: no case runs after the same
    one every time, and each gets one warm-up and `reps` timed calls."""
    round_robin = _bench_kernels().round_robin
    calls: list[str] = []
    cases = {name: (lambda name=name: calls.append(name)) for name in "abcd"}
    times = round_robin(cases, "cpu", reps=8)
    assert set(times.device) == set(times.with_launch) == set("abcd")
    assert all(t >= 0 for t in times.device.values()) and times.host_bound == []
    warm, timed = calls[:4], calls[4:]
    assert warm == list("abcd") and sorted(timed) == sorted("abcd" * 8)
    reps = [timed[i : i + 4] for i in range(0, 32, 4)]
    assert all(sorted(rep) == list("abcd") for rep in reps)
    for name in "abcd":
        before = {rep[rep.index(name) - 1] for rep in reps if rep.index(name) > 0}
        assert len(before) > 1, (name, reps)


def _bench_kernels():
    sys.path.insert(0, str(GPU_BENCH))
    try:
        import bench_kernels
    finally:
        sys.path.remove(str(GPU_BENCH))
    return bench_kernels


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bench_kernels_device_time_leaves_out_the_host():
    """A call whose host work (3 ms here; the Triton launcher's ~0.1 ms in the real rows) precedes its
    kernel: the device time is the kernel's alone, the time with the launch holds the host's too."""
    x = torch.zeros(1 << 20, device="cuda")

    def slow_host() -> None:
        time.sleep(0.003)
        x.add_(1)

    times = _bench_kernels().round_robin({"slow host": slow_host}, "cuda", reps=3)
    # The start event is stamped when the GPU reaches it, after the host records it: an H200 measured
    # 2.92 ms for the 3 ms sleep (2026-11-30), so the bound leaves half a millisecond for that latency
    # and still tells the host time (3 ms) from the kernel's alone (microseconds, the next line).
    assert times.with_launch["slow host"] >= 0.0025
    assert times.device["slow host"] < 0.001  # a 4 MB add: microseconds on any GPU
    # The first repetition sleeps 1 ms, short of the 3 ms; the others twice the host time seen.
    assert times.host_bound == []


def _seed(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


def _run_gpu_checks(work: Path, out: Path, **env: str) -> subprocess.CompletedProcess:
    """run_gpu_checks.sh with no step, no wheels and no GPU."""
    return subprocess.run(
        ["bash", str(GPU_BENCH / "run_gpu_checks.sh"), "none"],
        cwd=work, env={**os.environ, "OUT": str(out), **env}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_run_gpu_checks_seeds_the_cache_and_brings_back_the_autotune_results(tmp_path):
    """The device script seeds Triton's cache with the committed autotuning results, keeps what the
    cache already holds over the seed, and hands every result (and nothing else of its cache) back under
    $OUT as one tarball (the device tool returns at most 8 files, 2 folders down)."""
    cache = tmp_path / "work" / ".gpu-cache" / "triton"
    (cache / "abc123").mkdir(parents=True)
    (cache / "abc123" / "chunk_fwd_kernel.autotune.json").write_text('{"here": 1}')
    (cache / "abc123" / "chunk_fwd_kernel.cubin").write_bytes(b"\0" * 64)
    seed = _seed(tmp_path / "seed.tar.gz", {
        "./abc123/chunk_fwd_kernel.autotune.json": '{"seed": 1}',
        "./def456/l2norm.autotune.json": '{"seed": 2}',
    })  # fmt: skip
    out = tmp_path / "out"
    proc = _run_gpu_checks(tmp_path / "work", out, AUTOTUNE_SEED=str(seed))
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert saved == ["fla-autotune.tar.gz", "summary.txt"]
    with tarfile.open(out / "fla-autotune.tar.gz") as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
        assert names == ["./abc123/chunk_fwd_kernel.autotune.json", "./def456/l2norm.autotune.json"]
        assert tar.extractfile(names[0]).read() == b'{"here": 1}'  # the cache's own result wins
    assert "autotune results saved: 2" in (out / "summary.txt").read_text()


def test_the_committed_autotune_seed_holds_results_only():
    """The seed the script reads by default (a GPU session's `$OUT/fla-autotune.tar.gz`, committed):
    Triton autotuning results, each a JSON with the timings of its configs, and nothing else."""
    with tarfile.open(GPU_BENCH / "fla-autotune.tar.gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        assert members and all(m.name.endswith(".autotune.json") for m in members)
        for m in members:
            assert "configs_timings" in json.loads(tar.extractfile(m).read())


def _census(*args: str, model: str = "tiny-nemotron-h", runs: int = 1) -> dict | list[dict]:
    """The census's summary line (or its first `runs` lines: one per `--batch` size)."""
    proc = subprocess.run(
        [sys.executable, str(GPU_BENCH / "kernel_census.py"), "--model", model, *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines()[:runs]]
    return lines[0] if runs == 1 else lines


@nightly
def test_kernel_census_counts_what_the_triton_norm_saves():
    """The census of a decode step (meta device, CUDA's default kernels) counts every kernel: with the
    norms' Triton kernel (the CUDA default) the step runs fewer than with their torch form; and the
    kernels launched outside the CUDA graph, at every step."""
    fused, torch_form = _census(), _census("--env", "SGLANG_GPU_NORM_BACKEND=torch")
    assert fused["triton"] > torch_form["triton"] > 0  # the decode steps' kernels, plus one per norm
    assert 0 < fused["kernels"] < torch_form["kernels"]
    # Launched eagerly around the replay at every step: the batch's copy in, the placeholders' gather,
    # the lm_head, the argmax and the future tokens' write (11 with a `where` for the placeholders and
    # a float32 copy of the logits).
    assert fused["outside_graph"] == 5


def test_kernel_census_counts_what_the_stacked_linears_save():
    """Qwen3-Next's decode step with its linears stacked (the default) against SGLANG_STACK_LINEARS=0:
    each MoE layer saves the shared gate's GEMM, its cast and sigmoid, a fill and two concatenations
    (the routing launch appends the shared expert's pick: 6), each GDN layer one of its two input
    projections' GEMMs (1), each attention layer two of q / k / v's (2); nothing else changes. And the
    step at batch 8 launches as many kernels as at batch 1."""
    from transformers import AutoConfig

    from sglang.srt.configs.presets import resolve_model_path
    from sglang.srt.models.qwen3_next import is_sparse_layer

    stacked, stacked8 = _census("--batch", "1", "8", model="tiny-qwen3-next", runs=2)
    assert (stacked["batch"], stacked8["batch"]) == (1, 8)
    unstacked = _census("--env", "SGLANG_STACK_LINEARS=0", model="tiny-qwen3-next")
    config = AutoConfig.from_pretrained(resolve_model_path("tiny-qwen3-next"))
    layers = range(config.num_hidden_layers)
    moe = sum(is_sparse_layer(config, i) for i in layers)
    gdn = sum(config.layer_types[i] == "linear_attention" for i in layers)
    assert moe > 0 and gdn > 0
    attention = config.num_hidden_layers - gdn
    # q, k and v: two GEMMs fewer per attention layer
    assert unstacked["kernels"] - stacked["kernels"] == 6 * moe + gdn + 2 * attention
    assert unstacked["triton"] == stacked["triton"] and unstacked["outside_graph"] == stacked["outside_graph"]
    # Launched eagerly around the replay at every step (the batch's copy in, the placeholders' gather, the
    # lm_head, the argmax, the future tokens' write): 5.
    assert stacked["outside_graph"] == 5
    # No launch grows with the batch (views read in place: the GDN's mixed q|k|v, k, z; nothing copied).
    assert stacked8["kernels"] == stacked["kernels"]


def test_kernel_census_counts_what_fp8s_stacks_save():
    """Qwen3-Next's decode step in block FP8 as CUDA lays it out (experts and shared expert 128 wide:
    whole scale blocks, as published): each FP8 linear or stack of them (q / k / v, each o_proj and
    out_proj) one activation quantization and one block GEMM; each MoE layer's shared expert inside its
    FP8 experts' two grouped GEMMs, whose inputs take one quantization each (x; silu(gate) * up, fused),
    and the router with the shared gate one GEMM and one routing launch: no shared-expert kernel of its
    own (before: its three linears' six launches, the activation and the gated add)."""
    from transformers import AutoConfig

    from sglang.srt.configs.presets import resolve_model_path
    from sglang.srt.models.qwen3_next import is_sparse_layer

    widths = ("--override", "moe_intermediate_size=128", "--override", "shared_expert_intermediate_size=128")
    fp8 = _census("--quantization", "fp8", *widths, model="tiny-qwen3-next")
    config = AutoConfig.from_pretrained(resolve_model_path("tiny-qwen3-next"))
    layers = range(config.num_hidden_layers)
    moe = sum(is_sparse_layer(config, i) for i in layers)
    gdn = sum(config.layer_types[i] == "linear_attention" for i in layers)
    attention = config.num_hidden_layers - gdn
    by = fp8["triton_by_kernel"]
    assert by["_gemm_kernel"] == gdn + 2 * attention  # (the GDN's input projections stay dense, stacked)
    assert by["_quant_kernel"] == by["_gemm_kernel"] + 2 * moe
    assert by["_moe_gemm_kernel"] == 2 * moe and by["_softmax_topk_kernel"] == moe
    assert "_silu_mul_kernel" not in by and "_add_sigmoid_mul_kernel" not in by
    assert fp8["outside_graph"] == 5


def test_server_startup_timeline_reads_the_log_up_to_healthy(tmp_path):
    """bench_server_startup.py's timeline (the GPU run's start took 45 s, 28 of them outside the
    scheduler's own phases): each timestamped log line as seconds after the launch, lines past healthy
    (+1 s) left out, untimed lines (uvicorn's) skipped, /health last."""
    sys.path.insert(0, str(GPU_BENCH.parent))
    try:
        import bench_server_startup as bss
    finally:
        sys.path.remove(str(GPU_BENCH.parent))
    launched = time.mktime(time.strptime("2026-11-30 19:00:00", "%Y-%m-%d %H:%M:%S"))
    log = tmp_path / "server.log"
    log.write_text(
        "[2026-11-30 19:00:02,500] INFO launcher: Starting the scheduler, the detokenizer.\n"
        "INFO:     Started server process [1]\n"
        "[2026-11-30 19:00:30,250 scheduler] INFO Model loaded\n"
        "[2026-11-30 19:00:45,000] INFO ready\n"
        "[2026-11-30 19:01:00,000 scheduler] INFO Prefill batch after the start\n"
    )
    server = bss.Server.__new__(bss.Server)  # (no launch: the fields the timeline reads)
    server.log_path, server.launched_wall, server.healthy_s = log, launched, 45.1
    lines = bss.log_timeline(server)
    assert [line.split()[0] for line in lines] == ["2.50", "30.25", "45.00", "45.10"]
    assert lines[0].endswith("Starting the scheduler, the detokenizer.") and "health" in lines[-1]
