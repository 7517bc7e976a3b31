"""CPU tensor parallelism against one rank (issue 54): an Engine at --tp-size 1 and 2 on a 2-core machine
(each rank then takes one torch thread: 2 ranks on 2 cores, and one rank alone takes one too, a core being
left to the tokenizer and detokenizer), the same batch of greedy requests, output tokens per second after
a warm-up batch. Each size runs --repeats times (a fresh Engine each), alternating, and reports every run,
since the machine may be shared.

    python benchmark/bench_tp_cpu.py [--model-path tiny-qwen3-next-demo|147m] [--tp 1 2] [--batch 8]
                                     [--prompt-len 128] [--new-tokens 64] [--repeats 2]

`147m` is the random 147M Qwen3-Next of benchmark/gpu/bench_engine_vs_hf.py (written to /tmp on first
use), whose decode steps are bound by reading the weights; the demo preset is small enough that a step
is bound by per-op overhead, which tensor parallelism adds to (a broadcast per step, two all-reduces per
layer).
"""

from __future__ import annotations

import argparse
import json
import time

BIG = "/tmp/sglang-bench-147m"  # `--model-path 147m`: benchmark/gpu/bench_engine_vs_hf.py's checkpoint


def resolve(model: str) -> str:
    if model != "147m":
        return model
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "gpu"))
    from bench_engine_vs_hf import write_checkpoint

    if not Path(BIG, "config.json").exists():
        write_checkpoint(Path(BIG), small=False)
    return BIG


def run(model: str, tp: int, batch: int, prompt_len: int, new_tokens: int) -> dict:
    import sglang

    # Pools sized by hand: the CPU default (2% of the host's memory per rank) may not even hold 147M's
    # float32 weights.
    engine = sglang.Engine(
        model_path=model, tp_size=tp, log_level="warning", random_seed=1, mem_fraction_static=0.5,
        max_total_tokens=16384, max_mamba_cache_size=64, max_running_requests=batch,
    )  # fmt: skip
    try:
        prompts = [[(31 * i + 7 * j) % 1000 + 10 for j in range(prompt_len)] for i in range(batch)]
        params = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
        engine.generate(input_ids=[p[:16] for p in prompts], sampling_params={**params, "max_new_tokens": 4})
        engine.flush_cache()
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        took = time.perf_counter() - start
        tokens = sum(len(o["output_ids"]) for o in outs)
        return {
            "model": model,
            "tp": tp,
            "seconds": round(took, 2),
            "output_tokens": tokens,
            "tok_per_s": round(tokens / took, 1),
        }
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", default="tiny-qwen3-next-demo")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    model = resolve(args.model_path)
    for _ in range(args.repeats):
        for tp in args.tp:
            print(json.dumps(run(model, tp, args.batch, args.prompt_len, args.new_tokens)), flush=True)


if __name__ == "__main__":
    main()
