"""NGRAM speculative decoding against plain decoding on CPU, same requests, in one run:

    .venv/bin/python benchmark/bench_speculative_ngram.py                  # ~1-2 min
    .venv/bin/python benchmark/bench_speculative_ngram.py --draft-tokens 4 --reps 1
    .venv/bin/python benchmark/bench_speculative_ngram.py --model-path 147m --prompts 4 --output-len 64
        # the GPU benchmark's random 147M Qwen3-Next (written to /tmp on first use): weight-bound steps

Two schedulers in this process (plain, and --speculative-algorithm NGRAM), the same greedy requests:
1. `code`: the model (by default the demo, trained on Python) continues 16 snippets of the standard
   library's source, 128 new tokens each, all at once: drafts come from the prompts and from the text
   generated so far;
2. `repeat`: the same 16 requests again, after the first pass: drafts come from the first pass's outputs
   (the best case: a client that resends, or a rerun over the same documents).
Each workload is timed per repetition (caches flushed before, untimed), plain and NGRAM alternating;
`ngram_over_plain` is the median of per-repetition ratios of output tokens per second (above 1: NGRAM is
faster); `same_greedy_tokens` is the share of requests whose greedy tokens are the same on both sides.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import time

import torch

from sglang.srt.managers.io_struct import TokenizedGenerateReqInput
from sglang.srt.managers.scheduler import Scheduler
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import ServerArgs
from sglang.srt.speculative.ngram_cache import NgramCache

MODEL = "tiny-qwen3-next-demo"
BIG = "/tmp/sglang-bench-147m"  # `--model-path 147m`: benchmark/gpu/bench_engine_vs_hf.py's checkpoint


def snippets(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` prompts of `length` tokens from the source of standard-library modules."""
    import collections
    import json as json_module
    import logging

    text = "".join(inspect.getsource(m) for m in (collections, json_module.decoder, logging))
    ids = tokenizer(text)["input_ids"]
    step = (len(ids) - length) // n
    return [ids[i * step : i * step + length] for i in range(n)]


def run(sched: Scheduler, prompts: list[list[int]], out_len: int, tag: str) -> tuple[float, list[list[int]]]:
    outputs: dict[str, list[int]] = {}
    for k, ids in enumerate(prompts):
        params = SamplingParams.from_dict({"max_new_tokens": out_len, "temperature": 0, "ignore_eos": True})
        sched.add_request(
            TokenizedGenerateReqInput(rid=f"{tag}-{k}", input_text=None, input_ids=ids, sampling_params=params)
        )
        outputs[f"{tag}-{k}"] = []
    start = time.perf_counter()
    sched.run_until_idle()
    seconds = time.perf_counter() - start
    for msg in sched.detokenizer_outbox:
        for rid, ids in zip(msg.rids, msg.output_ids, strict=True):
            outputs[rid] += ids
    sched.detokenizer_outbox.clear()
    return seconds, [outputs[f"{tag}-{k}"] for k in range(len(prompts))]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", default=MODEL)
    parser.add_argument("--draft-tokens", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from sglang.srt.configs.presets import resolve_model_path

    model = args.model_path
    if model == "147m":
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).parent / "gpu"))
        from bench_engine_vs_hf import write_checkpoint

        if not Path(BIG, "config.json").exists():
            write_checkpoint(Path(BIG), small=False)
        model = BIG
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(model))
    prompts = snippets(tokenizer, args.prompts, args.input_len)
    base = dict(
        model_path=model, disable_overlap_schedule=True, random_seed=0, mamba_track_interval=256,
        max_total_tokens=32768, max_mamba_cache_size=256,
    )  # fmt: skip
    scheds = {
        "plain": Scheduler(ServerArgs(**base)),
        "ngram": Scheduler(
            ServerArgs(**base, speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.draft_tokens)
        ),
    }
    tokens = args.prompts * args.output_len
    report: dict = {"model": args.model_path, "torch_threads": torch.get_num_threads(), **vars(args)}
    for sched in scheds.values():
        run(sched, prompts[:2], 8, "warmup")
    ratios: dict[str, list[float]] = {"code": [], "repeat": []}
    same: list[float] = []  # the share of requests whose greedy tokens are the same on both sides
    speeds: dict[str, dict[str, list[float]]] = {w: {"plain": [], "ngram": []} for w in ratios}
    for rep in range(args.reps):
        outs = {}
        for name, sched in scheds.items():
            sched.flush_cache()
            if name == "ngram":  # a fresh n-gram cache per repetition: drafts come only from it
                c = sched.spec.cache
                sched.spec.cache = NgramCache(c.min_window, c.max_window, c.branch_length, c.capacity)
            code, outs[name] = run(sched, prompts, args.output_len, f"c{rep}")
            again, _ = run(sched, prompts, args.output_len, f"r{rep}")
            speeds["code"][name].append(tokens / code)
            speeds["repeat"][name].append(tokens / again)
        same.append(sum(a == b for a, b in zip(outs["ngram"], outs["plain"], strict=True)) / len(prompts))
        for w in ratios:
            ratios[w].append(speeds[w]["ngram"][-1] / speeds[w]["plain"][-1])
    for w in ratios:
        report[w] = {
            "plain_tok_s": round(statistics.median(speeds[w]["plain"]), 1),
            "ngram_tok_s": round(statistics.median(speeds[w]["ngram"]), 1),
            "ngram_over_plain": round(statistics.median(ratios[w]), 3),
        }
    # 1.0 on the demo model; a random checkpoint's near-ties may flip on ~1e-6 differences of the paths.
    report["same_greedy_tokens"] = min(same)
    report["ngram_totals"] = scheds["ngram"].spec.internal_state()
    print(json.dumps(report, indent=1))
    for sched in scheds.values():
        sched.shutdown()


if __name__ == "__main__":
    main()
