"""NEXTN (the demo model's own MTP layer drafts) against plain decoding on CPU, same requests, in one run:

    .venv/bin/python benchmark/bench_speculative_mtp.py                    # ~2-4 min on 2 busy cores
    .venv/bin/python benchmark/bench_speculative_mtp.py --steps 2 --reps 1

Two schedulers in this process (plain, and --speculative-algorithm NEXTN with --speculative-num-steps
k), the same greedy requests: held-out Python (modules the demo model never trained on, `HELD_OUT` of
`sglang.tools.train_tiny_model`), `--input-len` tokens of prompt, `--output-len` new tokens each, at batch
1 (one request at a time) and batch 8 (eight at once). Each is timed per repetition (caches flushed
before), plain and NEXTN alternating; `nextn_over_plain` is the median of per-repetition ratios of
output tokens per second; `accept_length` is NEXTN's tokens committed per request and verify;
`same_greedy_tokens` whether every request's tokens are the same on both sides. Prints one JSON object.

`--device cuda` (the server's CUDA graphs on): a third scheduler, NEXTN with its MTP layer run eagerly
(`nextn_eager_mtp`: the target's graphs only, no draft-loop or after-forward graphs), and
`mtp_graphs_speedup`, the median per-repetition ratio of NEXTN's output tokens per second with the MTP
layer's CUDA graphs (`speculative/mtp_graphs.py`) to without (that side's MTP graphs are released and
dropped from the target runner's companions: no memory held, none captured again); `accept_length_eager_mtp`
beside `accept_length`, the same requests' acceptance without the MTP graphs (they must be close: the
graphs compute what the eager layer does); `draft_graph_replays`, the draft loops a graph served.

    python3 benchmark/bench_speculative_mtp.py --device cuda --reps 2     # benchmark/gpu: step `mtp`

`--prefix-hit-len L` (a multiple of --mamba-track-interval, which it sets to L) measures instead the MTP
layer's acceptance after prefix hits that end where the request leaves the cached sequence: each prompt
B is first served cold, one at a time (caches flushed); then, after a flush, a request A = B[:L] + another
prompt's tokens runs first, so that B hits L cached tokens whose last position's MTP KV was written with
A's token at L, not B's (issue 57: the MTP KV at a hit's last position is the earlier request's), and B
runs again. `accept_length` of both, the hits' cached tokens and whether B's tokens are the same.

`--sampled-acceptance 0.7,1.0` measures instead, at each temperature, NEXTN's accept length with the two
draft rules of sampling requests (`speculative/mtp_draft.py`): `sampled_drafts`, the eager draft loop's
(each draft drawn from the MTP layer's distribution with the request's options, rejection sampling
against it; what a CPU server, batches over the largest graph and SGLANG_MTP_EAGER_SAMPLED_DRAFTS=1 do),
and `greedy_drafts`, the draft loop's CUDA graphs (`mtp_graphs.py`; on CPU their bodies, uncaptured:
`use_graphs=False`; the argmax chain, rejection sampling against one-hot(draft); what a GPU server does
for a batch that fits a graph). The same prompts, all at once (batch `--prompts`), `--reps` times per
side, no plain scheduler; `<side>_tok_s` their output tokens per second (on CPU the bodies are not
captured: what differs there is the rules' own work, the sampled one's [bs, k, vocab] distributions and
its accept lengths), `<side>_graph_replays` the draft loops a graph served.

    .venv/bin/python benchmark/bench_speculative_mtp.py --sampled-acceptance 0.7,1.0 --reps 2
    python3 benchmark/bench_speculative_mtp.py --device cuda --sampled-acceptance 0.7,1.0 --reps 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs

MODEL = "tiny-qwen3-next-demo"


def held_out_prompts(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens spread over the held-out modules' source."""
    from sglang.tools.train_tiny_model import corpus_files, read

    ids = tokenizer("".join(read(corpus_files()[1])))["input_ids"]
    step = (len(ids) - length) // n
    return [ids[i * step : i * step + length] for i in range(n)]


def run(
    sched: Scheduler,
    prompts: list[list[int]],
    out_len: int,
    tag: str,
    cached: list[int] | None = None,
    temperature: float = 0.0,
) -> tuple[float, list[list[int]]]:
    outputs: dict[str, list[int]] = {}
    for k, ids in enumerate(prompts):
        params = SamplingParams.from_dict(
            {"max_new_tokens": out_len, "temperature": temperature, "ignore_eos": True}
        )
        sched.add_request(
            TokenizedGenerateReqInput(
                rid=f"{tag}-{k}", input_text=None, input_ids=ids, sampling_params=params
            )
        )
        outputs[f"{tag}-{k}"] = []
    start = time.perf_counter()
    sched.run_until_idle()
    seconds = time.perf_counter() - start
    for msg in sched.detokenizer_outbox:
        for rid, ids, hit, done in zip(
            msg.rids, msg.output_ids, msg.cached_tokens, msg.finished_reasons, strict=True
        ):
            outputs[rid] += ids
            if cached is not None and done is not None:
                cached.append(hit)
    sched.detokenizer_outbox.clear()
    return seconds, [outputs[f"{tag}-{k}"] for k in range(len(prompts))]


def prefix_hit_acceptance(sched: Scheduler, prompts: list[list[int]], hit_len: int, out_len: int) -> dict:
    """NEXTN's accept length on prompts served cold and after a hit of `hit_len` tokens whose next token
    differs (module docstring)."""
    report, outs = {}, {}
    for case in ("cold", "stale_hit"):
        sched.flush_cache()
        if case == "stale_hit":
            n = len(prompts)
            firsts = [b[:hit_len] + prompts[(i + 1) % n][hit_len : hit_len + 32] for i, b in enumerate(prompts)]
            run(sched, firsts, 1, "first")
        before, cached = dict(sched.spec.stats), []
        outs[case] = [run(sched, [b], out_len, f"{case}{i}", cached)[1][0] for i, b in enumerate(prompts)]
        after = sched.spec.stats
        report[case] = {
            "accept_length": round(
                (after["committed_tokens"] - before["committed_tokens"])
                / max(after["verify_steps"] - before["verify_steps"], 1),
                4,
            ),
            "cached_tokens": cached,
        }
    report["same_greedy_tokens"] = outs["cold"] == outs["stale_hit"]
    return report


def draft_rule_acceptance(
    base: dict, nextn: dict, prompts: list[list[int]], temperatures: list[float], reps: int, out_len: int
) -> dict:
    """NEXTN's accept length (and output tokens per second) per temperature with sampled drafts (the
    eager loop) and greedy drafts (the draft loop's graphs, or on CPU their bodies), module docstring."""
    from contextlib import nullcontext

    from sglang.srt.environ import envs
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    scheds = {name: Scheduler(ServerArgs(**base, **nextn)) for name in ("sampled_drafts", "greedy_drafts")}
    greedy = scheds["greedy_drafts"]
    if greedy.spec.draft.graphs is None:  # (CPU: the graphs' bodies, uncaptured)
        sizes = [1, 2, 4, 8, 16]
        greedy.model_runner.graph_runner = CudaGraphRunner(greedy.model_runner, sizes, use_graphs=False)
        greedy.spec.draft.use_graphs(greedy.model_runner.graph_runner)
    report: dict = {}
    for temperature in temperatures:
        row = {}
        for name, sched in scheds.items():
            draft = sched.spec.draft
            before, loops = dict(sched.spec.stats), draft.loops
            replays = draft.graphs.replays if draft.graphs is not None else 0
            # The sampled side keeps its sampling draft batches on the eager loop (on CUDA it has graphs).
            sampled = name == "sampled_drafts"
            eager = envs.SGLANG_MTP_EAGER_SAMPLED_DRAFTS.override(True) if sampled else None
            seconds = 0.0
            with eager or nullcontext():
                for rep in range(reps):
                    sched.flush_cache()
                    tag = f"t{temperature}r{rep}"
                    seconds += run(sched, prompts, out_len, tag, temperature=temperature)[0]
            after = sched.spec.stats
            verifies = after["verify_steps"] - before["verify_steps"]
            row[name] = round((after["committed_tokens"] - before["committed_tokens"]) / max(verifies, 1), 3)
            row[f"{name}_tok_s"] = round(reps * len(prompts) * out_len / seconds, 1)
            if draft.graphs is not None:
                served = draft.graphs.replays - replays
                row[f"{name}_graph_replays"] = f"{served} of {draft.loops - loops} loops"
        report[f"temperature_{temperature}"] = row
    for sched in scheds.values():
        sched.shutdown()
    return report


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", default=MODEL)
    parser.add_argument("--steps", type=int, default=3, help="--speculative-num-steps (drafts per verify)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefix-hit-len", type=int, default=0, help="measure stale prefix hits instead")
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--sampled-acceptance", default="", help="temperatures (comma-separated): accept length per rule"
    )
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from sglang.srt.configs.presets import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model_path))
    prompts = held_out_prompts(tokenizer, args.prompts, args.input_len)
    base = dict(
        model_path=args.model_path, disable_overlap_schedule=True, random_seed=0, mamba_track_interval=256,
        max_total_tokens=32768, max_mamba_cache_size=256, device=args.device,
    )  # fmt: skip
    if args.prefix_hit_len:
        base["mamba_track_interval"] = args.prefix_hit_len
        sched = Scheduler(ServerArgs(**base, speculative_algorithm="NEXTN", speculative_num_steps=args.steps))
        report = {**vars(args), **prefix_hit_acceptance(sched, prompts, args.prefix_hit_len, args.output_len)}
        print(json.dumps(report, indent=1))
        sched.shutdown()
        return
    nextn = dict(speculative_algorithm="NEXTN", speculative_num_steps=args.steps)
    if args.sampled_acceptance:
        temperatures = [float(t) for t in args.sampled_acceptance.split(",")]
        report = draft_rule_acceptance(base, nextn, prompts, temperatures, args.reps, args.output_len)
        print(json.dumps({"torch_threads": torch.get_num_threads(), **vars(args), **report}, indent=1))
        return
    scheds = {"plain": Scheduler(ServerArgs(**base)), "nextn": Scheduler(ServerArgs(**base, **nextn))}
    if scheds["nextn"].spec.draft.graphs is not None:
        scheds["nextn_eager_mtp"] = Scheduler(ServerArgs(**base, **nextn))
        eager = scheds["nextn_eager_mtp"].spec.draft
        target_graphs = scheds["nextn_eager_mtp"].model_runner.graph_runner
        for companion in (eager.graphs, eager.forward_graphs):  # freed, and never captured again
            target_graphs.remove_companion(companion)
        eager.graphs = eager.forward_graphs = None  # (its draft loops and MTP layer after forwards: eager)
    report: dict = {"torch_threads": torch.get_num_threads(), **vars(args)}
    for sched in scheds.values():
        run(sched, prompts[:2], 8, "warmup")
    same = True
    for batch in (1, 8):
        speeds: dict[str, list[float]] = {name: [] for name in scheds}
        ratios: list[float] = []
        graph_ratios: list[float] = []
        spec_names = [name for name in scheds if name != "plain"]
        before = {name: dict(scheds[name].spec.stats) for name in spec_names}
        for rep in range(args.reps):
            outs: dict[str, list[list[int]]] = {}
            for name, sched in scheds.items():
                sched.flush_cache()
                seconds, outs[name] = 0.0, []
                for i in range(0, len(prompts), batch):
                    s, o = run(sched, prompts[i : i + batch], args.output_len, f"b{batch}r{rep}i{i}")
                    seconds += s
                    outs[name] += o
                speeds[name].append(len(prompts) * args.output_len / seconds)
            same = same and all(o == outs["plain"] for o in outs.values())
            ratios.append(speeds["nextn"][-1] / speeds["plain"][-1])
            if "nextn_eager_mtp" in speeds:
                graph_ratios.append(speeds["nextn"][-1] / speeds["nextn_eager_mtp"][-1])
        accept = {}
        for name in spec_names:
            after = scheds[name].spec.stats
            verifies = after["verify_steps"] - before[name]["verify_steps"]
            committed = after["committed_tokens"] - before[name]["committed_tokens"]
            accept[name] = round(committed / max(verifies, 1), 3)
        report[f"batch_{batch}"] = {
            "plain_tok_s": round(statistics.median(speeds["plain"]), 1),
            "nextn_tok_s": round(statistics.median(speeds["nextn"]), 1),
            "nextn_over_plain": round(statistics.median(ratios), 3),
            "accept_length": accept["nextn"],
        }
        if graph_ratios:
            report[f"batch_{batch}"].update(
                nextn_eager_mtp_tok_s=round(statistics.median(speeds["nextn_eager_mtp"]), 1),
                mtp_graphs_speedup=round(statistics.median(graph_ratios), 3),
                # The same requests' drafts with the MTP layer's graphs and without: the graphs compute
                # what the eager layer does (test_mtp_graphs' GPU tests), so these must be close.
                accept_length_eager_mtp=accept["nextn_eager_mtp"],
            )
    draft = scheds["nextn"].spec.draft
    if draft.graphs is not None:
        report["draft_graph_replays"] = f"{draft.graphs.replays} of {draft.loops} draft loops"
    report["same_greedy_tokens"] = same
    print(json.dumps(report, indent=1))
    for sched in scheds.values():
        sched.shutdown()


if __name__ == "__main__":
    main()
