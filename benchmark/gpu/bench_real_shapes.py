"""Decode and prefill at real model shapes (issue 55, item 1): slices of Qwen3-Next-80B-A3B, Nemotron-H-8B
and Qwen3.5-35B-A3B with every per-layer shape real and few layers (`real_shapes.py`), on the model runner
with the server's defaults (CUDA graphs on, chunked prefill as the server sizes it), against the floor of
each step, and the full models' numbers by layer count.

    python benchmark/gpu/bench_real_shapes.py --models qwen3-next-80b --out $OUT   # GPU, ~2-3 min a model
    python benchmark/gpu/bench_real_shapes.py --device cpu --tiny                  # CPU check, seconds
    python benchmark/gpu/bench_real_shapes.py --dry-run                            # the floors only, no run

Per model: the slice is written (bfloat16, built on the GPU; `--ckpt-dir` keeps it for the next run) and
loaded by `ModelRunner`. Decode, at batch 1 / 8 / 64 / 256: each request prefilled with `--prompt-len`
tokens, 3 untimed steps, then the median wall time of `--steps` steps (each ends in the read of the
sampled ids, as the server's does; no logprobs). Its floor: the bytes the step must move
(`real_shapes.decode_floor_bytes`: every weight but the embedding, the lm_head, the experts the batch
touches under uniform routing, each request's state read and written, its KV read) over the GPU's HBM
bandwidth (H200 4.8 TB/s, H100 3.35 TB/s by the device's name, or `--bandwidth-tbs`); the share is floor
/ step. Prefill, one prompt of 8,192 and of 32,768 tokens (in the server's chunks; none longer than
the model's context: Nemotron-H-8B-Base-8K's is 8,192, so its 32k row says skipped), one untimed run,
then the median of `--reps`: tokens/s and its share of the dense bf16 peak (989 TFLOP/s on an H100 or
H200 SXM, the spec sheets' dense figure, the same for both: kept so that shares compare across machines;
the facts file gives ~790 TFLOP/s for the test H200, against which a share is 1.25x higher; or
`--peak-tflops`) with FLOPs counted from the shapes (`real_shapes.prefill_flops_per_token`).

Full model, by layer count (the slice's layer kinds are in the full model's proportions): a decode step
is a fixed part (host batch building, embedding, final norm, lm_head, sampling, the sync and launches)
plus one part per layer, so the step is timed at two depths, the slice's and none (the same runner with
its decoder layers taken out and, on CUDA, its graphs captured again: `step0_ms`), and full decode =
step0 + (step - step0) / slice layers x full layers; its floor from the same parts at full depth.
(Scaling the whole step by the layer ratio counted the fixed part 12x for the 80B: 1.7x too high at
batch 1 on a CPU check.) Prefill = slice time x full layers / slice layers (its fixed part, one lm_head
row and the host work per chunk of 8k tokens, is negligible).

Prints one JSON line per row and a table per model; `--out DIR` also writes DIR/real_shapes.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_shapes as rs  # noqa: E402

_T0 = time.perf_counter()


def progress(what: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f} s] {what}", file=sys.stderr, flush=True)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _runner(
    path: Path, device: str, dtype: str, max_bs: int, max_tokens: int, quantization: str | None = None,
    verify_width: int = 0,
):  # fmt: skip
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    # (--verify-width: the target's verify rows and graphs as NGRAM sizes them; NEXTN's verify is the
    # same forward, its drafts the MTP layer's)
    spec = {"speculative_algorithm": "NGRAM", "speculative_num_draft_tokens": verify_width} if verify_width else {}
    args = ServerArgs(
        model_path=str(path),
        device=device,
        dtype=dtype,
        max_total_tokens=max_tokens,
        max_mamba_cache_size=max_bs * 2 + 2,
        max_running_requests=max_bs,
        random_seed=0,
        quantization=quantization,
        **spec,
    )
    return ModelRunner(args)


def _prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (n,), generator=g).tolist()  # inside every vocabulary, tiny ones too


def measure_decode(runner, device: str, batch: int, steps: int, prompt_len: int, chunk: int) -> float:
    """Median wall seconds of one decode step of `batch` requests."""
    return _median_step(
        runner, device, batch, steps, prompt_len, chunk,
        lambda driver, reqs: driver.decode(reqs, return_logprob=False),  # ends in next_token_ids.tolist()
    )  # fmt: skip


def measure_verify(runner, device: str, batch: int, steps: int, prompt_len: int, chunk: int, width: int) -> float:
    """Median wall seconds of one speculative verify of `batch` requests, each its last token and
    `width` - 1 drafts (graph-shaped: the verify graphs where captured), as `measure_decode` times a
    decode step."""
    # (each request's own drafts: one token repeated would route every position to the same experts)
    drafts = [_prompt(width - 1, 1000 + i) for i in range(batch)]
    return _median_step(
        runner, device, batch, steps, prompt_len, chunk,
        lambda driver, reqs: driver.verify(reqs, drafts, return_logprob=False, graph_shaped=True),
    )  # fmt: skip


def _median_step(runner, device: str, batch: int, steps: int, prompt_len: int, chunk: int, step) -> float:
    """`batch` requests prefilled (`prompt_len` tokens each, as many a chunk as fit), three untimed
    `step(driver, reqs)` calls, then the median wall seconds of `steps` more (each ends in a host read
    of its sampled ids: the device is done)."""
    from sglang.test.runner_driver import Extend, RunnerDriver

    driver = RunnerDriver(runner)
    reqs = [driver.new_request() for _ in range(batch)]
    per = max(1, chunk // prompt_len)
    for i in range(0, batch, per):
        group = reqs[i : i + per]
        driver.extend([Extend(r, _prompt(prompt_len, i + j)) for j, r in enumerate(group)], return_logprob=False)
    for _ in range(3):
        step(driver, reqs)
    _sync(device)
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        step(driver, reqs)
        walls.append(time.perf_counter() - t)
    for r in reqs:
        driver.free(r)
    return statistics.median(walls)


def measure_prefill(runner, device: str, tokens: int, chunk: int, reps: int) -> float:
    """Median wall seconds of one prompt of `tokens` tokens, in chunks of `chunk`, after one untimed run."""
    from sglang.test.runner_driver import Extend, RunnerDriver

    driver = RunnerDriver(runner)
    prompt = _prompt(tokens, tokens)
    times = []
    for rep in range(reps + 1):
        req = driver.new_request()
        _sync(device)
        t = time.perf_counter()
        for start in range(0, tokens, chunk):
            driver.extend([Extend(req, prompt[start : start + chunk])], return_logprob=False)
        times.append(time.perf_counter() - t)  # the last chunk's sampled id was read: the device is done
        driver.free(req)
        progress(f"  prefill {tokens}: {times[-1]:.3f} s" + (" (untimed)" if rep == 0 else ""))
    return statistics.median(times[1:])


def prefill_kernel_table(runner, device: str, tokens: int, chunk: int, top: int = 15) -> list[dict]:
    """One more prefill of `tokens` under torch's profiler: the `top` kernels (CUDA; on a CPU the ops) by
    total time, each with its share of the summed time, count and mean: where prefill goes."""
    from torch.profiler import ProfilerActivity, profile

    from sglang.test.runner_driver import Extend, RunnerDriver

    driver = RunnerDriver(runner)
    prompt = _prompt(tokens, tokens + 1)
    req = driver.new_request()
    cuda = device == "cuda"
    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for start in range(0, tokens, chunk):
            driver.extend([Extend(req, prompt[start : start + chunk])], return_logprob=False)
        _sync(device)
    driver.free(req)
    events = [e for e in prof.key_averages() if (e.device_type.name == "CUDA") == cuda]
    own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
    total = sum(own(e) for e in events) or 1.0
    events.sort(key=own, reverse=True)
    return [
        {"kernel": e.key[:90], "ms": round(own(e) / 1e3, 3), "share": round(own(e) / total, 3), "calls": e.count}
        for e in events[:top]
    ]


@contextmanager
def without_layers(runner, layers: int, recapture_after: bool = True):
    """The runner's model with its `layers` decoder layers taken out (the ModuleList of that length the
    decoder loops over): a step is then its fixed part alone. CUDA graphs are captured again for it, and
    once more on the way out, of the whole model; with `recapture_after` False they are freed instead and
    the runner decodes without graphs afterwards (a run whose later steps are prefills saves a capture)."""
    import torch.nn as nn

    decoder = next(
        m for m in runner.model.modules() if isinstance(getattr(m, "layers", None), nn.ModuleList)
        and len(m.layers) == layers
    )  # fmt: skip
    kept = decoder.layers
    graphs = runner.graph_runner
    decoder.layers = nn.ModuleList()
    try:
        if graphs is not None:
            graphs.recapture()
        yield
    finally:
        decoder.layers = kept
        if graphs is not None and recapture_after:
            graphs.recapture()
        elif graphs is not None:
            graphs.release()
            runner.graph_runner = None


def full_decode_ms(step_ms: float, step0_ms: float, slice_layers: int, full_layers: int) -> float:
    """The full model's decode step from the slice's (`step_ms`) and the step without layers
    (`step0_ms`): the fixed part once, the per-layer part at full depth."""
    return step0_ms + (step_ms - step0_ms) / slice_layers * full_layers


def _r(x: float | None, n: int = 4) -> float | None:
    """`x` to `n` significant digits (the CPU check's floors are microseconds)."""
    return None if x is None else float(f"{x:.{n}g}")


def run_model(name: str, args, bandwidth: float, peak: float) -> list[dict]:
    spec = rs.SLICES[name]
    device = args.device
    cuda = device == "cuda"
    dtype = torch.bfloat16 if cuda or args.dry_run else torch.float32  # the dry run accounts for the GPU's
    itemsize = dtype.itemsize
    config = rs.slice_config(name, args.tiny)
    t = time.perf_counter()
    path = None
    if args.dry_run:
        numels = rs.meta_numels(config)
    else:
        progress(f"{name}: the slice in {args.ckpt_dir} (written unless there)")
        path = rs.ensure_slice(name, args.ckpt_dir, device=device, tiny=args.tiny)
        progress(f"{name}: slice ready in {time.perf_counter() - t:.1f} s")
        numels = rs.checkpoint_numels(path)
    make_s = time.perf_counter() - t
    model, flop_fields = rs.step_model(config, numels, itemsize)
    full = model.scaled_to(spec.full_layers)
    head = {"slice": spec.pattern, "slice_layers": spec.slice_layers, "full_layers": spec.full_layers}
    rows = [
        {
            "model": name,
            "kind": "slice",
            **head,
            "params": sum(numels.values()),
            "weight_gb": _r(sum(numels.values()) * itemsize / 1e9),
            "bandwidth_tbs": bandwidth / 1e12,
            "peak_tflops": peak / 1e12,
            "make_s": round(make_s, 1),
        }
    ]
    if args.quantization:  # (the floors and shares stay the bf16 weights': compare the steps)
        rows[0]["quantization"] = f"{args.quantization} (at load); floors and shares of the bf16 weights"
    runner = None
    if not args.dry_run:
        t = time.perf_counter()
        longest = max([n for n in args.prefill if n <= config.max_position_embeddings], default=0)
        per_request = args.prompt_len + args.steps + 8 + (args.steps + 3) * args.verify_width
        max_tokens = max(max(args.batches) * per_request, longest + 64)
        runner = _runner(
            path, device, "bfloat16" if cuda else "float32", max(args.batches), max_tokens, args.quantization,
            args.verify_width,
        )  # fmt: skip
        rows[0]["load_s"] = round(time.perf_counter() - t, 1)
        progress(f"{name}: runner ready in {rows[0]['load_s']} s")
    print(json.dumps(rows[0]), flush=True)
    chunk = 8192
    if runner is not None:
        chunk = runner.server_args.chunked_prefill_size or 0
        chunk = chunk if chunk > 0 else max(args.prefill)
    context = args.prompt_len + 3 + args.steps // 2  # mean context over the timed steps
    steps, steps0, verifies = {}, {}, {}
    if runner is not None:
        for batch in args.batches:
            steps[batch] = measure_decode(runner, device, batch, args.steps, args.prompt_len, chunk) * 1e3
            progress(f"{name}: decode batch {batch}: {steps[batch]:.3f} ms")
        for batch in [b for b in args.batches if b <= 16] if args.verify_width else []:
            # (before the step without layers: the graphs are then the whole model's)
            verifies[batch] = (
                measure_verify(runner, device, batch, args.steps, args.prompt_len, chunk, args.verify_width) * 1e3
            )
            progress(f"{name}: verify of {args.verify_width} at batch {batch}: {verifies[batch]:.3f} ms")
        with without_layers(runner, spec.slice_layers, recapture_after=False):  # (prefills follow)
            for batch in args.batches:
                steps0[batch] = measure_decode(runner, device, batch, args.steps, args.prompt_len, chunk) * 1e3
                progress(f"{name}: decode batch {batch} without layers: {steps0[batch]:.3f} ms")
    for batch in args.batches:
        floor = rs.decode_floor_bytes(model, batch, context)
        full_floor = rs.decode_floor_bytes(full, batch, context)
        row = {
            "model": name,
            "kind": "decode",
            "batch": batch,
            "context": context,
            "experts_touched": round(floor["experts_touched_per_layer"], 1),
            "floor_gb": {k: _r(v / 1e9) for k, v in floor.items() if k != "experts_touched_per_layer"},
            "floor_ms": _r(floor["total"] / bandwidth * 1e3),
            "full_floor_ms": _r(full_floor["total"] / bandwidth * 1e3),
        }
        if runner is not None:
            step, step0 = steps[batch], steps0[batch]
            full_step = full_decode_ms(step, step0, spec.slice_layers, spec.full_layers)
            row.update(
                step_ms=_r(step),
                share=_r(row["floor_ms"] / step),
                step0_ms=_r(step0),
                full_step_ms=_r(full_step),
                full_share=_r(row["full_floor_ms"] / full_step),
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    for batch, verify in verifies.items():
        # Issue 57's target: a verify of 3-4 drafts at most 1.3x a decode step at batch 1-16, so that an
        # acceptance length of 2 gives 1.5x the decode tokens/s (the drafts' own steps left out here).
        graphs = runner.graph_runner
        row = {"model": name, "kind": "verify", "batch": batch, "width": args.verify_width,
               "verify_ms": _r(verify), "decode_ms": _r(steps[batch]),
               "verify_over_decode": _r(verify / steps[batch]),
               # (whether a captured verify graph served it: a capture that failed leaves it eager)
               "graph": bool(graphs is not None and graphs.use_graphs and batch <= graphs.verify_max_bs())}  # fmt: skip
        rows.append(row)
        print(json.dumps(row), flush=True)
    for tokens in args.prefill:
        flops = rs.prefill_flops_per_token(flop_fields, tokens) * tokens
        row = {
            "model": name,
            "kind": "prefill",
            "tokens": tokens,
            "chunk": chunk,
            "gflop_per_token": _r(flops / tokens / 1e9),
            "full_gflop_per_token": _r(flops / tokens / 1e9 * spec.full_layers / spec.slice_layers),
        }
        if tokens > config.max_position_embeddings:  # the server refuses it (--context-length is capped)
            row["skipped"] = f"beyond the model's {config.max_position_embeddings}-token context"
        elif runner is not None:
            seconds = measure_prefill(runner, device, tokens, chunk, args.reps)
            if args.kernel_table and tokens == min(t for t in args.prefill if t <= config.max_position_embeddings):
                row["kernels"] = prefill_kernel_table(runner, device, tokens, chunk)
            full_s = seconds * spec.full_layers / spec.slice_layers
            row.update(
                seconds=_r(seconds),
                tok_s=round(tokens / seconds),
                tflops=_r(flops / seconds / 1e12),
                share_peak=_r(flops / seconds / peak),
                full_seconds=_r(full_s),
                full_tok_s=round(tokens / full_s),
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if runner is not None:
        del runner
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    """The rows of one model as markdown: decode, then prefill, the full model's numbers beside."""
    s = rows[0]
    out = [
        f"### {s['model']}: slice {s['slice']} ({s['slice_layers']} of {s['full_layers']} layers), "
        f"{s['params'] / 1e9:.2f}B parameters, {s['weight_gb']} GB"
        + (f"; {s['quantization']}" if "quantization" in s else ""),
        "",
        "| batch | step | floor | share | experts / layer | step without layers | full model: step | floor | share |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ms = lambda v: "-" if v is None else f"{v:.4g} ms"  # noqa: E731
    pct = lambda v: "-" if v is None else f"{v:.0%}"  # noqa: E731
    for r in rows:
        if r["kind"] == "decode":
            out.append(
                f"| {r['batch']} | {ms(r.get('step_ms'))} | {ms(r['floor_ms'])} | {pct(r.get('share'))} | "
                f"{r['experts_touched']} | {ms(r.get('step0_ms'))} | {ms(r.get('full_step_ms'))} | "
                f"{ms(r['full_floor_ms'])} | "
                f"{pct(r.get('full_share'))} |"
            )
    out += ["", "| prefill tokens | GFLOP/token | time | tokens/s | TFLOP/s | share of peak | full model: time | tokens/s |"]
    out.append("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["kind"] == "prefill":
            sec = lambda v: "-" if v is None else f"{v:.3f} s"  # noqa: E731
            if "skipped" in r:
                out.append(f"| {r['tokens']} | {r['gflop_per_token']} | skipped: {r['skipped']} |||||")
                continue
            out.append(
                f"| {r['tokens']} | {r['gflop_per_token']} | {sec(r.get('seconds'))} | {r.get('tok_s', '-')} | {r.get('tflops', '-')} | "
                f"{pct(r.get('share_peak'))} | {sec(r.get('full_seconds'))} | {r.get('full_tok_s', '-')} |"
            )
    verifies = [r for r in rows if r["kind"] == "verify"]
    if verifies:
        out += ["", "| verify batch | positions | verify | decode step | verify / decode |", "|---|---|---|---|---|"]
        out += [
            f"| {r['batch']} | {r['width']} | {ms(r['verify_ms'])} | {ms(r['decode_ms'])} | {r['verify_over_decode']:.2f}x |"
            for r in verifies
        ]
    return "\n".join(out)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(rs.SLICES), help=f"comma-separated: {', '.join(rs.SLICES)}")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tiny", action="store_true", help="small hidden/experts/vocab, same layer patterns")
    parser.add_argument("--dry-run", action="store_true", help="the slices' accounting and floors only")
    parser.add_argument("--batches", type=_ints, default=None, help="default 1,8,64,256 (--tiny: 1,8)")
    parser.add_argument("--prefill", type=_ints, default=None, help="default 8192,32768 (--tiny: 256,2304: two chunks on a CPU)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--bandwidth-tbs", type=float, help="HBM bandwidth (default: by the device's name)")
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak (default: by the device's name)")
    parser.add_argument("--ckpt-dir", help="keep the slices here and reuse them (default: a temporary folder)")
    parser.add_argument("--out", help="also write the rows as DIR/real_shapes.json")
    parser.add_argument(
        "--kernel-table", action="store_true", help="the shortest prefill's top kernels, profiled once more"
    )
    parser.add_argument(
        "--quantization", choices=["fp8"], help="quantize the bf16 slice at load (issue 53: FP8 against bf16)"
    )
    parser.add_argument(
        "--verify-width", type=int, default=0,
        help="also time a speculative verify of this many positions (the last token + drafts) at batches up "
        "to 16 against the decode step (issue 57)",
    )  # fmt: skip
    args = parser.parse_args()
    if args.verify_width == 1 or args.verify_width < 0:
        parser.error("--verify-width: a verify has 2 positions or more (the last token and its drafts); 0 leaves it out")
    unknown = [m for m in args.models.split(",") if m not in rs.SLICES]
    if unknown:
        parser.error(f"--models: unknown {unknown}; choose from {list(rs.SLICES)}")
    args.batches = args.batches or ([1, 8] if args.tiny else [1, 8, 64, 256])
    args.prefill = args.prefill or ([256, 2304] if args.tiny else [8192, 32768])
    peaks = rs.device_peaks(torch.cuda.get_device_name()) if args.device == "cuda" else None
    if peaks is None and not (args.bandwidth_tbs and args.peak_tflops) and args.device == "cuda":
        parser.error("unknown GPU: pass --bandwidth-tbs and --peak-tflops")
    peaks = peaks or (rs.DEVICES[1][1], rs.DEVICES[1][2])  # the dry run and the CPU check: the H200's
    bandwidth = args.bandwidth_tbs * 1e12 if args.bandwidth_tbs else peaks[0]
    peak = args.peak_tflops * 1e12 if args.peak_tflops else peaks[1]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        args.ckpt_dir = args.ckpt_dir or tmp
        for name in args.models.split(","):
            rows = run_model(name, args, bandwidth, peak)
            results += rows
            print(table(rows) + "\n", flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "real_shapes.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
