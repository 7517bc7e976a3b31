"""Regenerates the benchmark report, `docs/benchmarks.md`, with its plots and data
(`docs/benchmarks/*.png`, `*.json`), in one run:

    .venv/bin/pip install -e ".[bench]"        # matplotlib, once
    .venv/bin/python benchmark/make_report.py  # ~15 min on 2 cores; --quick: ~3 min, smaller workloads

1. Strategy sweep: each preset x each `--mamba-scheduler-strategy`, a fixed mamba pool, two workloads
   through `python -m sglang.bench_serving` (shared-prefix groups; independent prompts): peak running
   requests, mean and peak mamba slots per running request, cache hit rate, TTFT, TPOT, throughput.
2. The engine against Hugging Face `generate` on the same checkpoint, one torch thread each: independent
   prompts and prompts sharing a long system prompt.
3. TTFT by prompt length: cold, a follow-up that extends a cached prompt (hit), an exact repeat.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import random
import statistics
import time
from pathlib import Path

import torch
from bench_exact_repeat import ttft

from sglang.bench_serving import make_parser, run_benchmark
from sglang.test.test_utils import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks"
PRESETS = ["tiny-qwen3-next", "tiny-nemotron-h"]
STRATEGIES = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]
MAMBA_POOL = 48  # fixed slots: what a strategy spends per request (its resident slots and the tree's
# headroom, `MambaStrategy.slots_per_running_req`) decides how many run at once


def workloads(quick: bool) -> dict[str, list[str]]:
    groups, per_group, prompts = (4, 4, 16) if quick else (8, 8, 64)
    return {
        "shared prefix": [
            "--dataset-name", "generated-shared-prefix", "--gsp-num-groups", str(groups),
            "--gsp-prompts-per-group", str(per_group), "--gsp-system-prompt-len", "1024",
            "--gsp-question-len", "64", "--gsp-output-len", "64",
        ],
        "independent": [
            "--dataset-name", "random", "--num-prompts", str(prompts), "--random-input-len", "256",
            "--random-output-len", "64", "--random-range-ratio", "1",
        ],
    }  # fmt: skip


def strategy_sweep(quick: bool) -> list[dict]:
    rows = []
    for preset in PRESETS:
        for strategy in STRATEGIES:
            cmd = ["--model-path", preset, "--mamba-scheduler-strategy", strategy]
            server = ServerProcess([*cmd, "--max-mamba-cache-size", str(MAMBA_POOL)])
            try:
                server.wait_ready()
                for name, flags in workloads(quick).items():
                    argv = ["--base-url", server.base_url, "--disable-tqdm", "--flush-cache", *flags]
                    with contextlib.redirect_stdout(io.StringIO()):
                        r = run_benchmark(make_parser().parse_args(argv))
                    rows.append({"preset": preset, "strategy": strategy, "workload": name, **r})
                    print(f"sweep {preset} {strategy} {name}: {r['output_throughput']:.0f} tok/s", flush=True)
            finally:
                server.stop()
    return rows


def engine_vs_hf(quick: bool) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from sglang import Engine
    from sglang.srt.configs.presets import resolve_model_path

    torch.set_num_threads(1)  # the engine's forward runs one thread on 2 cores (default_torch_threads)
    n, out_len, reps = (8, 32, 2) if quick else (32, 64, 3)
    rng = random.Random(0)
    system = [rng.randrange(10, 500) for _ in range(512)]
    cases = {
        "independent (128-token prompts)": [[rng.randrange(10, 500) for _ in range(128)] for _ in range(n)],
        "shared 512-token prefix": [system + [rng.randrange(10, 500) for _ in range(32)] for _ in range(n)],
    }
    rows = []
    for preset in PRESETS:
        model = AutoModelForCausalLM.from_pretrained(resolve_model_path(preset), dtype=torch.float32).eval()
        engine = Engine(model_path=preset, log_level="warning")
        try:
            for case, prompts in cases.items():
                sampling = {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0}
                hf_time = _median_time(lambda p=prompts, m=model: _hf_generate(m, p, out_len), reps)
                engine_time = _median_time(
                    lambda p=prompts, e=engine, s=sampling: _engine_generate(e, p, s),
                    reps,
                    engine.flush_cache,
                )
                times = {"hf": hf_time, "engine": engine_time}
                tokens = n * out_len
                rows.append(
                    {
                        "preset": preset,
                        "case": case,
                        "requests": n,
                        "output_len": out_len,
                        "hf_tok_s": tokens / times["hf"],
                        "engine_tok_s": tokens / times["engine"],
                        "engine_over_hf": times["hf"] / times["engine"],
                    }
                )
                print(f"engine vs hf {preset} {case}: {rows[-1]['engine_over_hf']:.2f}x", flush=True)
        finally:
            engine.shutdown()
    return rows


def _median_time(fn, reps: int, before=None) -> float:
    """Median seconds of `fn` over `reps` runs after one warm-up; `before` runs untimed before each."""
    fn()
    samples = []
    for _ in range(reps):
        if before is not None:
            before()
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _hf_generate(model, prompts: list[list[int]], out_len: int) -> None:
    with torch.no_grad():
        model.generate(torch.tensor(prompts), max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False)


def _engine_generate(engine, prompts: list[list[int]], sampling: dict) -> None:
    engine.generate(input_ids=prompts, sampling_params=sampling)


def ttft_by_length(quick: bool) -> list[dict]:
    lengths = [256, 1024, 2048] if quick else [256, 512, 1024, 2048, 4000]
    rounds = 2 if quick else 5
    rows = []
    for strategy in ("extra_buffer_lazy", "no_buffer"):
        server = ServerProcess(["--model-path", "tiny-qwen3-next", "--mamba-scheduler-strategy", strategy])
        try:
            server.wait_ready()
            for n in lengths:
                samples: dict[str, list[float]] = {"cold": [], "hit": [], "exact repeat": []}
                cached: dict[str, int] = {}
                for r in range(rounds):
                    rng = random.Random(1000 * n + r)
                    ids = [rng.randrange(10, 500) for _ in range(n)]
                    outputs: list[int] = []
                    for name in ("cold", "exact repeat", "hit"):
                        # hit: the next turn of a conversation (prompt, its answer, a new message)
                        prompt = (
                            ids + outputs + [rng.randrange(10, 500) for _ in range(64)]
                            if name == "hit"
                            else ids
                        )
                        t, c = ttft(server.base_url, prompt, outputs if name == "cold" else None)
                        samples[name].append(t)
                        cached[name] = c
                for name, times in samples.items():
                    rows.append(
                        {
                            "strategy": strategy,
                            "prompt_len": n,
                            "kind": name,
                            "ttft_ms": statistics.median(times) * 1000,
                            "cached_tokens": cached[name],
                        }
                    )
                print(f"ttft {strategy} {n}: done", flush=True)
        finally:
            server.stop()
    return rows


# ---- plots and page ----------------------------------------------------------------------------------


def plot_sweep(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [
        ("mean_slots_per_running_req", "mamba slots per running request (mean)"),
        ("peak_running_requests", "peak running requests"),
        ("cache_hit_rate", "cache hit rate"),
        ("output_throughput", "output tok/s"),
    ]
    combos = sorted({(r["preset"], r["workload"]) for r in rows})
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    width = 0.8 / len(combos)
    for ax, (key, title) in zip(axes.flat, metrics, strict=True):
        for k, (preset, workload) in enumerate(combos):
            values = []
            for s in STRATEGIES:
                match = [
                    r for r in rows if (r["preset"], r["workload"], r["strategy"]) == (preset, workload, s)
                ]
                values.append((match[0].get(key) or 0) if match else 0)
            xs = [i + k * width for i in range(len(STRATEGIES))]
            ax.bar(xs, values, width, label=f"{preset}, {workload}")
        ax.set_xticks([i + width * (len(combos) - 1) / 2 for i in range(len(STRATEGIES))], STRATEGIES)
        ax.set_title(title)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"Strategies side by side ({MAMBA_POOL} mamba slots)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_hf(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4))
    labels = [f"{r['preset']}\n{r['case']}" for r in rows]
    xs = range(len(rows))
    ax.bar([x - 0.2 for x in xs], [r["hf_tok_s"] for r in rows], 0.4, label="HF generate")
    ax.bar([x + 0.2 for x in xs], [r["engine_tok_s"] for r in rows], 0.4, label="engine")
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("output tok/s")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_ttft(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, strategy in zip(axes, ("extra_buffer_lazy", "no_buffer"), strict=True):
        for kind in ("cold", "hit", "exact repeat"):
            pts = sorted(
                (r["prompt_len"], r["ttft_ms"])
                for r in rows
                if (r["strategy"], r["kind"]) == (strategy, kind)
            )
            ax.plot([p for p, _ in pts], [t for _, t in pts], marker="o", label=kind)
        ax.set_title(strategy)
        ax.set_xlabel("prompt tokens")
    axes[0].set_ylabel("median TTFT (ms)")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    def cell(v):
        return f"{v:.2f}" if isinstance(v, float) else ("-" if v is None else str(v))

    head = "| " + " | ".join(title for _, title in cols) + " |"
    sep = "|" + "---|" * len(cols)
    body = ["| " + " | ".join(cell(r.get(key)) for key, _ in cols) + " |" for r in rows]
    return "\n".join([head, sep, *body])


def write_page(sweep: list[dict], hf: list[dict], ttfts: list[dict], quick: bool) -> None:
    machine = (
        f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}, torch {torch.__version__}"
    )
    sweep_cols = [
        ("preset", "preset"), ("workload", "workload"), ("strategy", "strategy"),
        ("peak_running_requests", "peak running"), ("mean_slots_per_running_req", "slots/req mean"),
        ("peak_slots_per_running_req", "slots/req peak"), ("cache_hit_rate", "hit rate"),
        ("median_ttft_ms", "TTFT p50 ms"), ("median_tpot_ms", "TPOT p50 ms"),
        ("output_throughput", "out tok/s"),
    ]  # fmt: skip
    hf_cols = [
        ("preset", "preset"), ("case", "case"), ("requests", "requests"), ("output_len", "output len"),
        ("hf_tok_s", "HF tok/s"), ("engine_tok_s", "engine tok/s"), ("engine_over_hf", "engine / HF"),
    ]  # fmt: skip
    ttft_cols = [
        ("strategy", "strategy"), ("prompt_len", "prompt"), ("kind", "request"),
        ("cached_tokens", "cached"), ("ttft_ms", "TTFT p50 ms"),
    ]  # fmt: skip
    page = f"""# Benchmarks

Generated by `benchmark/make_report.py`{" --quick" if quick else ""} (one command; data in
`docs/benchmarks/*.json`). Machine: {machine}. Tiny random-weight presets on CPU: the numbers compare
strategies and paths on the same machine in one run; they are not absolute speeds of real models.

## Strategies side by side

`python -m sglang.bench_serving` against one server per preset and strategy, `--max-mamba-cache-size
{MAMBA_POOL}`, all requests at once. "shared prefix": groups of requests sharing a 1,024-token system
prompt; "independent": random 256-token prompts. Slots per running request are sampled from
`/get_server_info` during the run.

![strategy sweep](benchmarks/strategy_sweep.png)

{_table(sweep, sweep_cols)}

How to choose: `no_buffer` holds one slot per request and caches a state only where a request ends or a
chunked prefill pauses, so shared prefixes hit only by chance (a chunk boundary inside the shared part); `extra_buffer` snapshots at chunk boundaries
(hits on shared prefixes and repeats) but holds 1 + 2 slots per request with overlap; `extra_buffer_lazy`
gets the same hits in one slot per running request (each snapshot is written into a slot borrowed from
the tree's share and handed to the tree at once), so a fixed pool runs more requests at once. The running
cap derived from the pool also keeps 2 slots per request for the radix tree (upstream's ratios 3, 5 and 3: {MAMBA_POOL} slots run at most {MAMBA_POOL // 3},
{MAMBA_POOL // 5} and {MAMBA_POOL // 3} requests). With a pool that is not the limit the two extra-buffer
strategies behave alike.

## The engine against Hugging Face `generate`

Same checkpoint, float32, greedy, every request generating its full length; one torch thread each. The
engine runs the batch through its scheduler (flushed cache before each run: no hits across runs);
HF runs the same prompts as one batch (equal lengths: no padding).

![engine vs HF](benchmarks/engine_vs_hf.png)

{_table(hf, hf_cols)}

## TTFT by prompt length

tiny-qwen3-next, one request at a time: a new prompt (cold), the same prompt again (exact repeat: the
cache can serve at most L - 1 tokens, and the prompt checkpoints make it serve (L - 1) // 64 * 64), and
the next turn of the conversation (hit: the prompt, its 2-token answer and 64 new tokens).

![TTFT](benchmarks/ttft_by_length.png)

{_table(ttfts, ttft_cols)}
"""
    (ROOT / "docs" / "benchmarks.md").write_text(page)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Smaller workloads (~3 min), same page.")
    args = parser.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    sweep = strategy_sweep(args.quick)
    ttfts = ttft_by_length(args.quick)
    hf = engine_vs_hf(args.quick)
    for name, rows in (("strategy_sweep", sweep), ("engine_vs_hf", hf), ("ttft_by_length", ttfts)):
        (OUT / f"{name}.json").write_text(json.dumps(rows, indent=1))
    plot_sweep(sweep, OUT / "strategy_sweep.png")
    plot_hf(hf, OUT / "engine_vs_hf.png")
    plot_ttft(ttfts, OUT / "ttft_by_length.png")
    write_page(sweep, hf, ttfts, args.quick)
    print(f"Wrote {ROOT / 'docs' / 'benchmarks.md'} and {OUT}/")


if __name__ == "__main__":
    main()
