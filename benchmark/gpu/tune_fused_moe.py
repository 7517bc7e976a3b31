"""Tunes the tiles of the fused 16-bit MoE GEMMs (`layers/moe/fused_moe_triton.py`) on a GPU and writes
the JSON files `layers/moe/moe_configs.py` looks up (one per shape and GPU: copy them into
`python/sglang/srt/layers/moe/configs/`).

For each shape below and each batch size, each GEMM (w13: rows gathered by token, silu(gate) * up in
its epilogue; w2: sorted rows) is timed with each candidate tile as a CUDA graph replays it
(`triton.testing.do_bench_cudagraph`: no host launch cost in the time), on the routing of uniform random
top-k picks; the fastest candidate per (batch, GEMM) is written. A small candidate set, so that both
shapes finish in ~3 minutes on an H200 (compiles included); each row also gives the fallback tile's
time and the floor (the touched experts' weights streamed once at the GPU's peak bandwidth).

    python benchmark/gpu/tune_fused_moe.py --out /tmp/moe-configs        # on the GPU machine
    TRITON_INTERPRET=1 python benchmark/gpu/tune_fused_moe.py --device cpu --tiny --out /tmp/x   # CPU check
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import peak_bandwidth  # noqa: E402

from sglang.srt.layers.moe import moe_configs as mc  # noqa: E402
from sglang.srt.layers.moe.fused_moe_fp8_triton import MoeGemmConfig, tile_map  # noqa: E402
from sglang.srt.layers.moe.fused_moe_triton import moe_gemm  # noqa: E402
from sglang.srt.layers.moe.sort_combine import sort_by_expert  # noqa: E402

# name -> (experts, hidden, intermediate width, top k): the routed experts of each model, unsharded.
SHAPES = {
    "qwen3-next-80b": (512, 2048, 512, 10),
    "qwen3.5-35b-a3b": (256, 2048, 512, 8),
}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CANDIDATES = mc.TUNE_CANDIDATES
TINY = {"tiny": (8, 64, 32, 2)}


def _time(fn, device: str, reps_ms: int) -> float:
    """Seconds per call."""
    if device != "cuda":
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t
    import triton.testing

    return triton.testing.do_bench_cudagraph(fn, rep=reps_ms) / 1e3


def _gemm_call(gemm: str, x, h, w13, w2, s, n_rows: int, cfg: MoeGemmConfig):
    """One GEMM of the layer with tile `cfg`, its tile map made beforehand (as one layer's two GEMMs share
    it): w13 gathers x's rows by token and applies silu(gate) * up, w2 reads h's rows in sorted order."""
    tile_end = tile_map(s.offs, cfg.block_m)
    if gemm == "w13":
        return lambda: moe_gemm(x, w13, s.offs, n_rows, s.token_of, cfg, tile_end, silu_mul=True)
    return lambda: moe_gemm(h, w2, s.offs, n_rows, None, cfg, tile_end)


def tune_shape(
    e: int, hidden: int, inter: int, top_k: int, batches, device: str, reps_ms: int
) -> tuple[dict, list]:
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, 2 * inter, hidden, device=device, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(e, hidden, inter, device=device, generator=g) / inter**0.5).to(dtype)
    table, rows = {}, []
    for batch in batches:
        x = torch.randn(batch, hidden, device=device, generator=g).to(dtype)
        ids = torch.rand(batch, e, device=device, generator=g).topk(top_k, dim=1).indices
        s = sort_by_expert(ids, e, use_triton=True)
        n_rows = ids.numel()
        h = torch.randn(n_rows, inter, device=device, generator=g).to(dtype)
        touched = ids.unique().numel()
        nbytes = {"w13": touched * w13[0].numel() * 2, "w2": touched * w2[0].numel() * 2}
        best = {}
        for gemm in ("w13", "w2"):
            timings = {}
            fallback = mc.fallback_config(n_rows, e)
            candidates = CANDIDATES if device == "cuda" else CANDIDATES[:1]  # the interpreter: a check only
            for cfg in dict.fromkeys([*candidates, fallback]):
                fn = _gemm_call(gemm, x, h, w13, w2, s, n_rows, cfg)
                try:
                    fn()
                    timings[cfg] = _time(fn, device, reps_ms)
                except Exception as err:  # noqa: BLE001 - a tile that does not launch here is not a choice
                    print(
                        f"  {gemm} batch {batch} {tuple(cfg)}: {type(err).__name__}: {err}", file=sys.stderr
                    )
            best[gemm] = min(timings, key=timings.get)
            row = {"experts": e, "batch": batch, "gemm": gemm, "touched_experts": touched,
                   "best": tuple(best[gemm]), "best_us": round(timings[best[gemm]] * 1e6, 2),
                   "fallback_us": round(timings.get(fallback, float("nan")) * 1e6, 2)}  # fmt: skip
            peak = peak_bandwidth(device)
            if peak is not None:
                row["floor_us"] = round(nbytes[gemm] / peak * 1e6, 2)
                row["best_fraction_of_floor"] = round(nbytes[gemm] / peak / timings[best[gemm]], 3)
            print(json.dumps(row), flush=True)
            rows.append(row)
        table[batch] = (best["w13"], best["w2"])
    return table, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny shape (a CPU run under TRITON_INTERPRET=1)"
    )
    parser.add_argument("--out", required=True, help="folder for the JSON files (and rows.json)")
    parser.add_argument("--rep-ms", type=int, default=10, help="milliseconds of replays per timing")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device_name = mc.device_name(torch.device(args.device))
    shapes, batches = (TINY, (1, 4)) if args.tiny else (SHAPES, BATCHES)
    all_rows = []
    start = time.perf_counter()
    for name, (e, hidden, inter, top_k) in shapes.items():
        table, rows = tune_shape(e, hidden, inter, top_k, batches, args.device, args.rep_ms)
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float16
        path = out / mc.config_file_name(e, inter, hidden, dtype, device_name)
        path.write_text(mc.table_to_json(table) + "\n")
        assert mc.parse_table(path.read_text(), str(path)) == table
        print(f"{name}: wrote {path} ({time.perf_counter() - start:.0f} s so far)", flush=True)
        all_rows += rows
    (out / "rows.json").write_text(json.dumps(all_rows, indent=1))


if __name__ == "__main__":
    main()
