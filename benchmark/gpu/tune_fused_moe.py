"""Tunes the tiles of the fused 16-bit MoE GEMMs (`layers/moe/fused_moe_triton.py`) on a GPU and writes
the JSON files `layers/moe/moe_configs.py` looks up (one per shape and GPU: copy them into
`python/sglang/srt/layers/moe/configs/`).

Both models' layers run their shared expert (as wide as a routed one) as expert E of E + 1 stacked
experts that every token picks once more (`FusedExperts.fuse_shared`), so by default each shape is tuned
as the server runs it: GEMMs over E + 1 experts, top-k + 1 picks per token (the k routed ones uniform
among the E, plus the shared one), written to the file of E + 1 (`E=513` for the 80B), the name the
server looks the stacks' tiles up by; `--unstacked` tunes the routed experts alone (E, top-k: layers
whose shared expert does not stack). The shapes are TP 1's (the whole width on one GPU).

For each shape below and each batch size, each GEMM (w13: rows gathered by token, silu(gate) * up in
its epilogue; w2: sorted rows) is timed with each candidate tile (`moe_configs.TUNE_CANDIDATES`) as a
CUDA graph replays it (no host launch cost in the time): one graph of CALLS calls, each on its own
uniform random top-k routing, so that a call reads other experts than the one before, from HBM as a
decode step's layer does (the same routing again would find a batch-1 call's 10 experts, 40 MB of w13,
in the H200's 50 MB L2), replayed REPLAYS times, the median per call kept. The fastest tile per (batch,
GEMM) is written. Compiles dominate (~36 of a few seconds each at most), so both shapes should finish in
~2-3 minutes on an H200 (estimated; not yet run on a GPU). Each row also gives the fallback tile's time
and the floor (the touched experts' weights streamed once at the GPU's peak bandwidth).

    python benchmark/gpu/tune_fused_moe.py --out /tmp/moe-configs        # on the GPU machine
    TRITON_INTERPRET=1 python benchmark/gpu/tune_fused_moe.py --device cpu --tiny --out /tmp/x   # CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_kernels import peak_bandwidth  # noqa: E402

from sglang.srt.layers.moe import moe_configs as mc  # noqa: E402
from sglang.srt.layers.moe.fused_moe_fp8_triton import (  # noqa: E402
    MoeGemmConfig,
    config_by_mean_rows,
    tile_map,
)
from sglang.srt.layers.moe.fused_moe_triton import moe_gemm  # noqa: E402
from sglang.srt.layers.moe.sort_combine import sort_by_expert  # noqa: E402

# name -> (routed experts, hidden, intermediate width, top k): each model's experts at TP 1. Both have a
# shared expert of the routed width (512), which the server stacks as one more expert.
SHAPES = {
    "qwen3-next-80b": (512, 2048, 512, 10),
    "qwen3.5-35b-a3b": (256, 2048, 512, 8),
}
BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
CANDIDATES = mc.TUNE_CANDIDATES
TINY = {"tiny": (8, 64, 32, 2)}


CALLS, REPLAYS = 16, 5


def _time(fns: list, device: str) -> float:
    """Seconds per call of the `fns` (each already run once: compiled)."""
    if device != "cuda":
        t = time.perf_counter()
        for fn in fns:
            fn()
        return (time.perf_counter() - t) / len(fns)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    per_call = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / 1e3 / len(fns))
    return statistics.median(per_call)


def _gemm_call(gemm: str, x, h, w13, w2, s, n_rows: int, cfg: MoeGemmConfig):
    """One GEMM of the layer with tile `cfg`, its tile map made beforehand (as one layer's two GEMMs share
    it): w13 gathers x's rows by token and applies silu(gate) * up, w2 reads h's rows in sorted order."""
    tile_end = tile_map(s.offs, cfg.block_m)
    if gemm == "w13":
        return lambda: moe_gemm(x, w13, s.offs, n_rows, s.token_of, cfg, tile_end, silu_mul=True)
    return lambda: moe_gemm(h, w2, s.offs, n_rows, None, cfg, tile_end)


def routing(batch: int, e: int, top_k: int, stacked: bool, device: str, g) -> torch.Tensor:
    """[batch, top_k (+ 1 where `stacked`)] expert ids: top_k distinct uniform among the E routed experts,
    then, `stacked`, the shared expert (id E), as `FusedExperts.forward` appends it to every token."""
    ids = torch.rand(batch, e, device=device, generator=g).topk(top_k, dim=1).indices
    return torch.cat([ids, ids.new_full((batch, 1), e)], 1) if stacked else ids


def tune_shape(
    e: int, hidden: int, inter: int, top_k: int, batches, device: str, stacked: bool = True
) -> tuple[dict, list]:
    """Times the tiles at E routed experts (E + 1 GEMM experts and top-k + 1 picks where `stacked`)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16  # the interpreter's bf16 dot is wrong
    g = torch.Generator(device=device).manual_seed(0)
    gemm_e, picks = (e + 1, top_k + 1) if stacked else (e, top_k)
    w13 = (torch.randn(gemm_e, 2 * inter, hidden, device=device, generator=g) / hidden**0.5).to(dtype)
    w2 = (torch.randn(gemm_e, hidden, inter, device=device, generator=g) / inter**0.5).to(dtype)
    table, rows = {}, []
    calls = CALLS if device == "cuda" else 1
    for batch in batches:
        n_rows = batch * picks
        inputs = []  # per call: (x, h, its sorted routing), each call on another routing
        touched = 0
        for _ in range(calls):
            ids = routing(batch, e, top_k, stacked, device, g)
            x = torch.randn(batch, hidden, device=device, generator=g).to(dtype)
            h = torch.randn(n_rows, inter, device=device, generator=g).to(dtype)
            inputs.append((x, h, sort_by_expert(ids, gemm_e, use_triton=True)))
            touched += ids.unique().numel() / calls
        nbytes = {"w13": touched * w13[0].numel() * 2, "w2": touched * w2[0].numel() * 2}
        best = {}
        for gemm in ("w13", "w2"):
            timings = {}
            fallback = config_by_mean_rows(mc.FALLBACK_CONFIGS, n_rows, gemm_e)  # as pick_configs
            candidates = CANDIDATES if device == "cuda" else CANDIDATES[:1]  # the interpreter: a check only
            for cfg in dict.fromkeys([*candidates, fallback]):
                fns = [_gemm_call(gemm, x, h, w13, w2, s, n_rows, cfg) for x, h, s in inputs]
                try:
                    fns[0]()
                    timings[cfg] = _time(fns, device)
                except Exception as err:  # noqa: BLE001 - a tile that does not launch here is not a choice
                    print(
                        f"  {gemm} batch {batch} {tuple(cfg)}: {type(err).__name__}: {err}", file=sys.stderr
                    )
            best[gemm] = min(timings, key=timings.get)
            row = {"experts": gemm_e, "shared_stacked": stacked, "top_k": picks, "batch": batch, "gemm": gemm,
                   "touched_experts": round(touched, 1), "best": tuple(best[gemm]),
                   "best_us": round(timings[best[gemm]] * 1e6, 2),
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
    parser.add_argument(
        "--unstacked", action="store_true", help="the routed experts alone (E, top-k), no shared expert"
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device_name = mc.device_name(torch.device(args.device))
    shapes, batches = (TINY, (1, 4)) if args.tiny else (SHAPES, BATCHES)
    all_rows = []
    start = time.perf_counter()
    for name, (e, hidden, inter, top_k) in shapes.items():
        table, rows = tune_shape(e, hidden, inter, top_k, batches, args.device, not args.unstacked)
        dtype = torch.bfloat16 if args.device == "cuda" else torch.float16
        # Named by the GEMMs' experts: E + 1 for the stacks, what `FusedExperts` looks them up by.
        gemm_e = e if args.unstacked else e + 1
        path = out / mc.config_file_name(gemm_e, inter, hidden, dtype, device_name)
        path.write_text(mc.table_to_json(table) + "\n")
        assert mc.parse_table(path.read_text(), str(path)) == table
        print(f"{name}: wrote {path} ({time.perf_counter() - start:.0f} s so far)", flush=True)
        all_rows += rows
    (out / "rows.json").write_text(json.dumps(all_rows, indent=1))


if __name__ == "__main__":
    main()
