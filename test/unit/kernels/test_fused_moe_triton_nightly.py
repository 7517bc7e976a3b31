"""The fused 16-bit MoE GEMMs (layers/moe/fused_moe_triton.py), the slower checks: every tile of the
fallback table, of the tuning script's candidates and of the committed tuned files compiled for sm_90 as both GEMMs launch it (w13: rows
gathered by token, silu(gate) * up in the epilogue; w2: sorted rows), pipelined, without spills; and the
layer's non-silu activations (applied between the GEMMs) under `TRITON_INTERPRET=1`; the CPU checks of
the tuning script and of bench_kernels.py's MoE rows; the tiny Qwen3-Next in float16 through them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sglang.srt.layers.moe import fused_moe_fp8_triton as mf
from sglang.srt.layers.moe import moe_configs as mc
from sglang.test.ci_register import register_cpu_ci
from sglang.test.moe_checks import TOL_FP16, check_layer_runs_fused
from sglang.test.sm90 import compile_sm90_in_registers

register_cpu_ci(est_time=120, suite="nightly-cpu")

GPU_BENCH = Path(__file__).resolve().parents[3] / "benchmark" / "gpu"


def _all_configs() -> list[mc.MoeGemmConfig]:
    configs = {cfg for _, cfg in mc.FALLBACK_CONFIGS} | set(mc.TUNE_CANDIDATES)
    for path in sorted(mc.CONFIG_DIR.glob("*.json")):
        for pair in mc.parse_table(path.read_text(), str(path)).values():
            configs.update(pair)
    return sorted(configs)


SIGNATURE = {
    "a_ptr": "*bf16", "as_ptr": "*bf16", "b_ptr": "*bf16", "bs_ptr": "*bf16", "c_ptr": "*bf16",
    "token_ptr": "*i64", "offs_ptr": "*i32", "tile_end_ptr": "*i32",
    **{name: "i32" for name in ("N", "K", "a_stride", "AS_COLS", "BS_COLS", "b_expert_stride",
                                "bs_expert_stride")},
    **{name: "constexpr" for name in ("E", "E_POW2", "GATHER", "SCALE_N", "SCALE_K", "BLOCK_M", "BLOCK_N",
                                      "BLOCK_K", "FP8", "SILU_MUL", "RELU2")},
}  # fmt: skip


@pytest.mark.parametrize("cfg", _all_configs(), ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("gemm", ["w13", "w2"])
def test_moe_gemm_bf16_compiles_for_sm90(cfg, gemm):
    """Qwen3-Next-80B's experts (512; N, K and the strides multiples of 16 there): each tile compiles
    for sm_90 in bf16 without spills, on tensor cores (mma / wgmma), and its pipeline's stages in shared
    memory (the w13 GEMM holds a gate and an up tile per stage)."""
    w13 = gemm == "w13"
    constexprs = dict(E=512, E_POW2=512, GATHER=w13, SCALE_N=1, SCALE_K=1, BLOCK_M=cfg.block_m,
                      BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FP8=False, SILU_MUL=w13, RELU2=False)  # fmt: skip
    compiled = compile_sm90_in_registers(
        mf._moe_gemm_kernel, SIGNATURE, constexprs, ("N", "K", "a_stride", "b_expert_stride"),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    ptx = compiled.asm["ptx"]
    assert "mma" in ptx and "bf16" in ptx
    b_tiles = 2 if w13 else 1
    per_stage = (cfg.block_m + b_tiles * cfg.block_n) * cfg.block_k * 2
    assert compiled.metadata.shared >= (cfg.num_stages - 1) * per_stage


@pytest.mark.parametrize(
    "tokens,top_k,e,act,gated",
    [(5, 2, 6, "gelu", True), (4, 2, 4, "relu2", False)],
    ids=["gated-gelu", "plain-relu2"],
)
def test_other_activations(monkeypatch, tokens, top_k, e, act, gated):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_layer_runs_fused(monkeypatch, tokens, top_k, e, act, gated)


def _script_rows(script: str, *args: str) -> list[dict]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, str(GPU_BENCH / script), "--device", "cpu", "--tiny", *args],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
def test_the_tuning_script_writes_a_file_the_lookup_reads(tmp_path, stacked):
    """tune_fused_moe.py's CPU check: a row per (batch, GEMM) and a file of the lookup's name that parses,
    with the best tile of each row. By default as the server runs the layer, its shared expert stacked:
    GEMMs over E + 1 = 9 experts with top-k + 1 = 3 picks, in the file of E = 9 (the name
    `FusedExperts` looks the stacks' tiles up by); --unstacked: 8 experts, top 2, E = 8."""
    rows = _script_rows("tune_fused_moe.py", "--out", str(tmp_path), *([] if stacked else ["--unstacked"]))
    assert [(r["batch"], r["gemm"]) for r in rows] == [(1, "w13"), (1, "w2"), (4, "w13"), (4, "w2")]
    gemm_e, picks = (9, 3) if stacked else (8, 2)
    assert all((r["experts"], r["top_k"], r["shared_stacked"]) == (gemm_e, picks, stacked) for r in rows)
    name = mc.config_file_name(gemm_e, 32, 64, torch.float16, "cpu")
    assert [p.name for p in tmp_path.glob("E=*.json")] == [name]
    table = mc.parse_table((tmp_path / name).read_text(), name)
    assert {b: tuple(tuple(c) for c in cfgs) for b, cfgs in table.items()} == {
        b: tuple(tuple(r["best"]) for r in rows if r["batch"] == b) for b in (1, 4)
    }


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked", "unstacked"])
def test_bench_kernels_moe_rows(stacked):
    """bench_kernels.py --moe's CPU check: one row per batch, the three cases timed (ours, ours with the
    bookkeeping in three launches, the grouped_mm path), and the fused GEMMs' output within the float16
    bound of the grouped_mm path's (moe_checks.TOL_FP16); by default with the shared expert stacked (as
    served), --moe-unstacked without it."""
    rows = _script_rows("bench_kernels.py", "--moe", "--reps", "1", *([] if stacked else ["--moe-unstacked"]))
    assert [r["kernel"].split(",")[0] for r in rows] == ["MoE experts bs 1", "MoE experts bs 4"]
    for r in rows:
        assert r["shared_expert"] == ("stacked as expert E" if stacked else "none")
        assert set(r["ms"]) == {
            "ours (fused Triton GEMMs)", "grouped_mm path (forward_device)", "ours, bookkeeping in 3 launches"
        }
        assert all(ms > 0 for ms in r["ms"].values())
        assert r["max_abs_diff_over_max"] < TOL_FP16


def test_engine_through_the_fused_gemms_as_through_the_torch_form(monkeypatch):
    """tiny-qwen3-next in float16, prefill then 4 greedy decode steps of 2 requests, with
    SGLANG_GPU_MOE_BACKEND=triton_fused (interpreted; every MoE layer's shared expert stacked into the
    fused GEMMs at load) and =torch: the same tokens, logprobs within 0.03. Measured 0.0078 apart (the
    float16 model rounds each path's sums differently through 4 layers); 0.03 is ~4x that, below what a
    wrong expert or shared-expert weight moves them."""
    from sglang.srt.environ import envs
    from sglang.srt.layers.moe.experts import RoutedExperts
    from sglang.test.model_checks import greedy_tokens_and_logprobs, make_runner

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs = []
    for backend in ("triton_fused", "torch"):
        with envs.SGLANG_GPU_MOE_BACKEND.override(backend), envs.SGLANG_CPU_MOE_BACKEND.override("torch"):
            runner = make_runner("tiny-qwen3-next", mamba_scheduler_strategy="extra_buffer", dtype="float16")
        experts = [m for m in runner.model.modules() if isinstance(m, RoutedExperts)]
        fused = [m.fused_gemms is not None and m.fused_gemms.stack is not None for m in experts]
        assert experts and fused == [backend == "triton_fused"] * len(experts)
        runs.append(greedy_tokens_and_logprobs(runner, (17, 26), steps=4))
    (tok_a, lp_a), (tok_b, lp_b) = runs
    assert tok_a == tok_b
    torch.testing.assert_close(torch.as_tensor(lp_a), torch.as_tensor(lp_b), rtol=0, atol=0.03)
