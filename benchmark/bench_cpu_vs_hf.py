"""The engine against Hugging Face `generate` on CPU, same checkpoint, same torch thread count, in one run:

    .venv/bin/python benchmark/bench_cpu_vs_hf.py              # both presets, 5 repetitions, ~4-5 min
    .venv/bin/python benchmark/bench_cpu_vs_hf.py --reps 1 --preset tiny-qwen3-next   # a quick look

Workloads (issue 19's):
1. independent prompts: 64 prompts x (128 input + 128 output) tokens, all sent at once;
2. multi-turn shared prefix: 16 conversations x 4 turns over one 1,024-token system prompt; each turn adds a
   128-token user message to the conversation so far and generates 128 tokens; the 16 conversations of a
   turn are sent at once (HF generates them as one batch: equal lengths, no padding);
3. TTFT of a 2,048-token prompt: cold, a partial hit (the first 1,984 tokens were served before) and an
   exact repeat; HF has no prefix cache, so its three times are one forward of the prompt.

Every workload is timed after one warm-up; the engine's cache is flushed (untimed) before each repetition,
so hits come only from within the repetition. Greedy with `ignore_eos`, so both sides generate exactly the
same number of tokens. `engine_over_hf` is the engine's speed over HF's (HF time / engine time: above 1,
the engine is faster), the median of per-repetition ratios, HF and engine alternating.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

PRESETS = ["tiny-qwen3-next", "tiny-nemotron-h"]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 500) for _ in range(n)]


def _timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


class Hf:
    def __init__(self, preset: str):
        from transformers import AutoModelForCausalLM

        from sglang.srt.configs.presets import resolve_model_path

        path = resolve_model_path(preset)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def generate(self, prompts: list[list[int]], out_len: int) -> list[list[int]]:
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor(prompts),
                attention_mask=torch.ones(len(prompts), len(prompts[0]), dtype=torch.long),
                max_new_tokens=out_len,
                min_new_tokens=out_len,
                do_sample=False,
            )
        return out[:, len(prompts[0]) :].tolist()


class Eng:
    def __init__(self, preset: str, strategy: str):
        from sglang import Engine

        self.engine = Engine(model_path=preset, mamba_scheduler_strategy=strategy, log_level="warning")

    def generate(self, prompts: list[list[int]], out_len: int) -> list[list[int]]:
        sampling = {"max_new_tokens": out_len, "ignore_eos": True, "temperature": 0}
        outs = self.engine.generate(input_ids=prompts, sampling_params=sampling)
        return [o["output_ids"] for o in outs]

    def flush(self) -> None:
        assert self.engine.flush_cache().success


def independent(gen, seed: int, n: int = 64, in_len: int = 128, out_len: int = 128) -> None:
    rng = random.Random(seed)
    gen([_ids(rng, in_len) for _ in range(n)], out_len)


def multi_turn(gen, seed: int, convs: int = 16, turns: int = 4, system: int = 1024, msg: int = 128) -> None:
    rng = random.Random(seed)
    prefix = _ids(rng, system)
    history = [list(prefix) for _ in range(convs)]
    for _ in range(turns):
        prompts = [h + _ids(rng, msg) for h in history]
        answers = gen(prompts, msg)
        history = [p + a for p, a in zip(prompts, answers, strict=True)]


def ttft_cases(seed: int, length: int = 2048, tail: int = 64) -> dict[str, list[list[int]]]:
    """Per case, the requests sent in order; only the last one is timed."""
    rng = random.Random(seed)
    prompt = _ids(rng, length)
    partial = prompt[: length - tail]
    return {"cold": [prompt], "partial hit": [partial, prompt], "exact repeat": [prompt, prompt]}


def run_preset(preset: str, strategy: str, reps: int) -> list[dict]:
    torch.set_num_threads(1)  # the engine's forward also runs one thread on a 2-core machine
    hf, eng = Hf(preset), Eng(preset, strategy)
    rows = []
    try:
        for name, work in (("independent 64 x (128 + 128)", independent), ("multi-turn 16 x 4", multi_turn)):
            work(hf.generate, 0)  # warm-up
            eng.flush()
            work(eng.generate, 0)
            hf_t, eng_t = [], []
            for r in range(reps):
                hf_t.append(_timed(work, hf.generate, r + 1))
                eng.flush()
                eng_t.append(_timed(work, eng.generate, r + 1))
            rows.append(_row(preset, strategy, name, hf_t, eng_t))
            print(json.dumps(rows[-1]), flush=True)
        for case in ("cold", "partial hit", "exact repeat"):
            hf_t, eng_t = [], []
            for r in range(reps + 1):
                prompt = ttft_cases(100 + r)[case][-1]
                h = _timed(hf.generate, [prompt], 1)
                eng.flush()
                *untimed, last = ttft_cases(100 + r)[case]
                for p in untimed:
                    eng.generate([p], 1)
                e = _timed(eng.generate, [last], 1)
                if r:  # the first round warms both up
                    hf_t.append(h)
                    eng_t.append(e)
            rows.append(_row(preset, strategy, f"TTFT 2048 {case}", hf_t, eng_t))
            print(json.dumps(rows[-1]), flush=True)
    finally:
        eng.engine.shutdown()
    return rows


def _row(preset: str, strategy: str, name: str, hf_t: list[float], eng_t: list[float]) -> dict:
    return {
        "preset": preset,
        "strategy": strategy,
        "workload": name,
        "hf_s": round(statistics.median(hf_t), 4),
        "engine_s": round(statistics.median(eng_t), 4),
        "engine_over_hf": round(statistics.median(h / e for h, e in zip(hf_t, eng_t, strict=True)), 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=PRESETS, action="append")
    parser.add_argument("--strategy", default="extra_buffer_lazy")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    rows = [r for p in args.preset or PRESETS for r in run_preset(p, args.strategy, args.reps)]
    print("\n| preset | workload | HF s | engine s | speedup (HF s / engine s) |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['workload']} | {r['hf_s']} | {r['engine_s']} | {r['engine_over_hf']}x |")


if __name__ == "__main__":
    main()
