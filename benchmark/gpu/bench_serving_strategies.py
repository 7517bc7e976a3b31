"""`bench_serving` with the mamba scheduler strategies side by side on one checkpoint (issue 55, item 5):

    python benchmark/gpu/bench_serving_strategies.py --slice qwen3-next-80b --ckpt-dir .gpu-cache/slices
    python benchmark/gpu/bench_serving_strategies.py --model-path tiny-qwen3-next --quick   # CPU check

One server per strategy (`no_buffer`, `extra_buffer`, `extra_buffer_lazy`), one at a time, with the
server's defaults otherwise. Round r starts them in the order rotated by r, so no strategy is always the
first on a fresh machine (whose first server compiles the kernels for the workload's shapes). Each server
first serves the workload once untimed (kernels compiled, the shared prefixes in its radix cache: caches
warm), then `--reps` timed runs, the cache not flushed. Per strategy, medians over every timed run:
output tokens/s, cache hit rate, mean TTFT and TPOT; one JSON line per run and a table at the end.

Workload (`python -m sglang.bench_serving`'s generated-shared-prefix): 8 groups x 16 prompts, a 2,048-token
system prompt per group, 128-token questions, 256 output tokens (`--quick`: 2 x 2, 128, 16, 8). `--slice`
writes (or reuses) a real-shape slice (`real_shapes.py`) on the GPU; a full round there is three server
starts (~40 s each with the 80B slice's 14.4 GB, by the facts file) plus the runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

STRATEGIES = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]
METRICS = ["output_throughput", "cache_hit_rate", "mean_ttft_ms", "mean_tpot_ms"]


def rotated(items: list[str], r: int) -> list[str]:
    """`items` started at position r (mod its length)."""
    r %= len(items)
    return items[r:] + items[:r]


def workload(quick: bool) -> list[str]:
    groups, per_group, system, question, out = (2, 2, 128, 16, 8) if quick else (8, 16, 2048, 128, 256)
    return [
        "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups),
        "--gsp-prompts-per-group", str(per_group), "--gsp-system-prompt-len", str(system),
        "--gsp-question-len", str(question), "--gsp-output-len", str(out), "--seed", "0",
    ]  # fmt: skip


def serve_and_bench(model_path: str, strategy: str, extra: list[str], flags: list[str], reps: int) -> list[dict]:
    from sglang.bench_serving import make_parser, run_benchmark
    from sglang.test.test_utils import ServerProcess

    server = ServerProcess(["--model-path", model_path, "--mamba-scheduler-strategy", strategy, *extra])
    try:
        server.wait_ready()
        argv = ["--base-url", server.base_url, "--disable-tqdm", *flags]
        runs = []
        for rep in range(reps + 1):  # the first: untimed warm-up
            with contextlib.redirect_stdout(io.StringIO()):
                result = run_benchmark(make_parser().parse_args(argv))
            if rep:
                runs.append({k: result.get(k) for k in METRICS})
        return runs
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-path", help="a checkpoint folder or preset")
    src.add_argument("--slice", help="a real-shape slice of real_shapes.SLICES, written on the GPU if missing")
    parser.add_argument("--ckpt-dir", default=".gpu-cache/slices", help="where --slice keeps its checkpoint")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=1, help="timed runs per server, after its warm-up")
    parser.add_argument("--quick", action="store_true", help="a small workload (CPU check)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--server-args", default="", help="more server flags, one string")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        parser.error(f"--strategies: unknown {unknown}; choose from {STRATEGIES}")
    model_path = args.model_path
    if args.slice:
        import real_shapes as rs
        import torch

        if args.slice not in rs.SLICES:
            parser.error(f"--slice: unknown {args.slice!r}; choose from {list(rs.SLICES)}")
        device = "cuda" if torch.cuda.is_available() else "cpu"
        model_path = str(rs.ensure_slice(args.slice, args.ckpt_dir, device=device))
    flags = workload(args.quick)
    runs: dict[str, list[dict]] = {s: [] for s in strategies}
    for r in range(args.rounds):
        for strategy in rotated(strategies, r):
            for i, run in enumerate(serve_and_bench(model_path, strategy, args.server_args.split(), flags, args.reps)):
                runs[strategy].append(run)
                print(json.dumps({"round": r, "strategy": strategy, "rep": i, **run}), flush=True)
    print("\n| strategy | output tok/s | cache hit rate | mean TTFT | mean TPOT | runs |")
    print("|---|---|---|---|---|---|")
    for s in strategies:
        med = {k: statistics.median(x[k] for x in runs[s]) for k in METRICS}
        row = {"strategy": s, "median": True, **{k: round(v, 4) for k, v in med.items()}}
        print(json.dumps(row))
        print(
            f"| {s} | {med['output_throughput']:.0f} | {med['cache_hit_rate']:.2f} | "
            f"{med['mean_ttft_ms']:.1f} ms | {med['mean_tpot_ms']:.2f} ms | {len(runs[s])} |"
        )


if __name__ == "__main__":
    main()
