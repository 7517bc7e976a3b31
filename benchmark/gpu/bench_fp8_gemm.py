"""The block-FP8 GEMM and FP8 experts (issue 53, item 2) against torch's bfloat16 at Qwen3-Next-80B's real
shapes, timed round-robin (medians; `ms` the device time, `ms_with_launch` with the host's launch, as in
`bench_kernels.py`, whose timer this uses).

    python benchmark/gpu/bench_fp8_gemm.py                  # on the GPU machine, ~1-2 min
    python benchmark/gpu/bench_fp8_gemm.py --sweep          # every tile of the config tables at every shape
    TRITON_INTERPRET=1 python benchmark/gpu/bench_fp8_gemm.py --device cpu    # a CPU check of the script
    python benchmark/gpu/bench_fp8_gemm.py --only dense --decode    # decode M only: split-K or not

Rows:
- dense: each of the 80B's projections (N x K) at decode M 1 / 8 / 16 / 64 / 256 and prefill M 8,192:
  the FP8 GEMM on pre-quantized activations (`fp8`, the table's config), with the activation
  quantization (`fp8+quant`, as a layer runs it) and `a @ w.T` in bfloat16 (`bf16`); TFLOP/s and the
  share of the GPU's dense FP8 peak (issue 53's target at prefill shapes: >= 60 %), and for decode the
  share of HBM bandwidth the weight bytes reach. At M <= 64 also the table's tile with K split
  automatically (`fp8 split-k`, `fp8_kernel.split_k_for`) and unsplit (`fp8 unsplit`), and their ratio
  `split_k_over_unsplit` (above 1: the split is faster): which `GEMM_CONFIGS` rows should split (issue
  53's decode target: FP8 >= 1.6x bf16 tokens/s at the 80B's shapes).
- moe: the 80B's routed experts (512 x width 512, top 10, hidden 2,048) through `RoutedExperts` at
  1 / 64 / 256 / 8,192 tokens under uniform random routing: FP8 weights (the FP8 kernels) against the
  same layer in bfloat16 (grouped GEMMs).
Where torch's block-wise `_scaled_mm` runs (`SGLANG_FP8_GEMM_BACKEND=cublas`, `fp8_scaled_mm.py`), each
dense row also times it (`fp8 cublas`, with the quantization `fp8+quant cublas`) and gives
`cublas_over_triton`, `cublas_over_bf16` and its share of the FP8 peak: whether it should be the default.
`--sweep` adds one row per (shape, tile) of `fp8_kernel.GEMM_CONFIGS` and of the MoE table: how those
tables were meant to be revised (they were chosen without a GPU).
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kernels import peak_bandwidth, round_robin  # noqa: E402

# Dense FP8 tensor-core peak (no sparsity), TFLOP/s by GPU name: H100 SXM and H200 ~1,979.
PEAK_FP8_TFLOPS = {"H100": 1979.0, "H200": 1979.0}
# Qwen3-Next-80B-A3B's dense projections, (name, N, K).
DENSE_SHAPES = [
    ("gdn in_proj_qkvz", 12288, 2048), ("gdn in_proj_ba", 64, 2048), ("gdn out_proj", 2048, 4096),
    ("attn q_proj (gated)", 8192, 2048), ("attn k_proj / v_proj", 512, 2048), ("attn o_proj", 2048, 4096),
    ("shared expert gate_up", 1024, 2048), ("shared expert down", 2048, 512),
]  # fmt: skip
TINY_DENSE = [("tiny", 200, 256)]
DECODE_M, PREFILL_M = (1, 8, 16, 64, 256), 8192


def _peak_tflops(device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    return next((p for key, p in PEAK_FP8_TFLOPS.items() if key in name), None)


def dense_rows(device: str, tiny: bool, reps: int, sweep: bool, decode_only: bool = False) -> list[dict]:
    from sglang.srt.layers.quantization import fp8_kernel as fk
    from sglang.srt.layers.quantization import fp8_scaled_mm as sm

    peak, bandwidth = _peak_tflops(device), peak_bandwidth(device)
    # torch's block-wise _scaled_mm (SGLANG_FP8_GEMM_BACKEND=cublas): where the probe passes (its warning
    # in the log says why not)
    cublas = device == "cuda" and sm.available(torch.device(device))
    rows = []
    for name, n, k in TINY_DENSE if tiny else DENSE_SHAPES:
        w_bf16 = (torch.randn(n, k, device=device) / k**0.5).to(torch.bfloat16)
        w_scale = torch.ones(-(-n // 128), -(-k // 128), device=device) / 64
        w = (w_bf16.float() * 64).to(fk.FP8_DTYPE)
        for m in (1, 5) if tiny else DECODE_M if decode_only else (*DECODE_M, PREFILL_M):
            a = torch.randn(m, k, device=device).to(torch.bfloat16)
            aq, a_s = fk.per_token_group_quant_fp8(a)
            gemm = partial(fk.w8a8_block_fp8_matmul, weight=w, weight_scale_inv=w_scale)
            cases = {
                "fp8": partial(gemm, aq, a_scale=a_s),
                "fp8+quant": partial(gemm, a),
                "bf16": partial(torch.matmul, a, w_bf16.t()),
            }
            if cublas and sm.fits(m, n, k, (128, 128)):
                cases["fp8 cublas"] = partial(sm.scaled_mm_blockwise, aq, a_s, w, w_scale, torch.bfloat16)
                cases["fp8+quant cublas"] = partial(_quant_then_scaled_mm, a, w, w_scale)
            if m <= 64:
                table = fk.gemm_config(m)
                # (split as the automatic rule would at any K: the server splits only from SPLIT_K_MIN_K)
                splits = fk.auto_splits(table, m, n, aq.device)
                for label, split in (("fp8 split-k", splits), ("fp8 unsplit", 1)):
                    cases[label] = partial(gemm, aq, a_scale=a_s, config=table._replace(split_k=split))
            if sweep:
                for cfg in (*(cfg for _, cfg in fk.GEMM_CONFIGS), *fk.GEMM_SWEEP_ONLY):
                    label = f"fp8 {cfg.block_m}x{cfg.block_n} w{cfg.num_warps} s{cfg.num_stages} k{cfg.split_k}"
                    cases[label] = partial(gemm, aq, a_scale=a_s, config=cfg)
            times = round_robin(cases, device, reps)
            flops = 2 * m * n * k
            row = {
                "kernel": f"dense {name}", "m": m, "n": n, "k": k,
                "ms": {c: round(t * 1e3, 4) for c, t in times.device.items()},
                "ms_with_launch": {c: round(t * 1e3, 4) for c, t in times.with_launch.items()},
                "tflops": {c: round(flops / t / 1e12, 1) for c, t in times.device.items()},
                "fp8_over_bf16": round(times.device["bf16"] / times.device["fp8"], 2),
                "config": fk.gemm_config(m)._asdict(),
                "k_split": fk.split_k_for(fk.gemm_config(m)._replace(split_k=0), m, n, k, a.device),
            }  # fmt: skip
            if "fp8 split-k" in times.device:
                row["split_k_over_unsplit"] = round(times.device["fp8 unsplit"] / times.device["fp8 split-k"], 2)
            if peak:
                row["share_of_fp8_peak"] = round(flops / times.device["fp8"] / 1e12 / peak, 3)
            if "fp8 cublas" in times.device:
                row["cublas_over_triton"] = round(times.device["fp8"] / times.device["fp8 cublas"], 2)
                row["cublas_over_bf16"] = round(times.device["bf16"] / times.device["fp8 cublas"], 2)
                if peak:
                    row["cublas_share_of_fp8_peak"] = round(flops / times.device["fp8 cublas"] / 1e12 / peak, 3)
            elif device == "cuda":
                row["fp8_cublas"] = "shape does not fit" if cublas else "unavailable (the log says why)"
            if bandwidth and m <= 256:
                row["weight_bandwidth_share"] = round(n * k / times.device["fp8"] / bandwidth, 3)
            rows.append(row)
    return rows


def _quant_then_scaled_mm(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    from sglang.srt.layers.quantization import fp8_kernel as fk
    from sglang.srt.layers.quantization import fp8_scaled_mm as sm

    return sm.scaled_mm_blockwise(*fk.per_token_group_quant_fp8(a), w, w_scale, torch.bfloat16)


def moe_rows(device: str, tiny: bool, reps: int, sweep: bool) -> list[dict]:
    from sglang.srt.layers.moe import fused_moe_fp8_triton as mf
    from sglang.srt.layers.moe.experts import RoutedExperts
    from sglang.srt.layers.quantization import fp8_kernel as fk

    e, hidden, inter, top_k = (4, 128, 64, 2) if tiny else (512, 2048, 512, 10)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    layers = {}
    for kind in ("fp8", "bf16"):
        layer = RoutedExperts(e, hidden, inter, "silu", gated=True).to(device)
        layers[kind] = layer
    w13 = torch.randn(e, 2 * inter, hidden, device=device, dtype=dtype) / hidden**0.5
    w2 = torch.randn(e, hidden, inter, device=device, dtype=dtype) / inter**0.5
    layers["bf16"].w13.data, layers["bf16"].w2.data = w13, w2
    fp8 = layers["fp8"]
    fp8.w13.data, fp8.w2.data = (w13.float() * 64).to(fk.FP8_DTYPE), (w2.float() * 64).to(fk.FP8_DTYPE)
    fp8.w13_weight_scale_inv = torch.ones(e, -(-2 * inter // 128), -(-hidden // 128), device=device) / 64
    fp8.w2_weight_scale_inv = torch.ones(e, -(-hidden // 128), -(-inter // 128), device=device) / 64
    for layer in layers.values():
        layer.process_weights_after_loading()
    rows = []
    for tokens in (2,) if tiny else (1, 64, 256, PREFILL_M):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        ids = torch.rand(tokens, e, device=device).topk(top_k, dim=1).indices
        weights = torch.rand(tokens, top_k, device=device)
        cases = {kind: partial(layer, x, weights, ids) for kind, layer in layers.items()}
        if sweep:
            args = (x, fp8.w13, fp8.w13_weight_scale_inv, fp8.w2, fp8.w2_weight_scale_inv, weights, ids)
            for _, cfg in mf.MOE_GEMM_CONFIGS:
                cases[f"fp8 {cfg.block_m}x{cfg.block_n}"] = partial(
                    mf.fused_experts_fp8, *args, fp8._activate, config=cfg, silu_and_mul=True
                )
        times = round_robin(cases, device, reps)
        touched = torch.unique(ids).numel()
        weight_bytes = touched * 3 * inter * hidden  # fp8: one byte per weight of each touched expert
        row = {
            "kernel": "moe experts", "tokens": tokens, "experts": e, "top_k": top_k, "touched_experts": touched,
            "ms": {c: round(t * 1e3, 4) for c, t in times.device.items()},
            "ms_with_launch": {c: round(t * 1e3, 4) for c, t in times.with_launch.items()},
            "fp8_over_bf16": round(times.device["bf16"] / times.device["fp8"], 2),
            "config": mf.config_by_mean_rows(mf.MOE_GEMM_CONFIGS, tokens * top_k, e)._asdict(),
        }  # fmt: skip
        bandwidth = peak_bandwidth(device)
        if bandwidth:
            row["fp8_weight_bandwidth_share"] = round(weight_bytes / times.device["fp8"] / bandwidth, 3)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (implied on CPU)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--sweep", action="store_true", help="every tile of the config tables")
    parser.add_argument("--only", choices=("dense", "moe"), default=None)
    parser.add_argument("--decode", action="store_true", help="dense rows at decode M only (no prefill)")
    args = parser.parse_args(argv)
    tiny = args.tiny or args.device == "cpu"
    torch.manual_seed(0)
    if args.only != "moe":
        for row in dense_rows(args.device, tiny, args.reps, args.sweep, args.decode):
            print(json.dumps(row), flush=True)
    if args.only != "dense":
        for row in moe_rows(args.device, tiny, args.reps, args.sweep):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
