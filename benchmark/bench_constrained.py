"""What constrained decoding costs: output tokens per second of the same batch of requests, plain and held
to a grammar, on one server in one run (the two kinds alternate, medians):

    .venv/bin/python benchmark/bench_constrained.py [--requests 16] [--tokens 96] [--rounds 3]

The grammar is a regex whose shortest text is longer than the token budget (`[a-z ]{2000}`), so the
constrained requests run exactly as many steps as the plain ones (ignore_eos on both). Each step of a
constrained batch fills every request's mask (xgrammar, on the scheduler thread), moves it with the
batch and applies it before sampling; while such a request runs, the overlap schedule processes each
batch before building the next. A third kind mixes them: half plain, half constrained.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from sglang.test.test_utils import ServerProcess

GRAMMAR = {"regex": "[a-z ]{2000}"}


def batch(base_url: str, n: int, tokens: int, constrained: list[bool]) -> float:
    """Output tokens per second of `n` concurrent requests (`constrained[i]`: request i has the grammar)."""

    def one(i: int) -> int:
        params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
        if constrained[i]:
            params.update(GRAMMAR)
        body = {"input_ids": [(7 * i + j) % 400 + 20 for j in range(32)], "sampling_params": params}
        r = requests.post(base_url + "/generate", json=body, timeout=600)
        r.raise_for_status()
        return r.json()["meta_info"]["completion_tokens"]

    start = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        total = sum(pool.map(one, range(n)))
    return total / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen3-next-demo")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    n = args.requests
    kinds = {"plain": [False] * n, "constrained": [True] * n, "half constrained": [k % 2 == 0 for k in range(n)]}
    server = ServerProcess(["--model-path", args.model, "--mamba-scheduler-strategy", "extra_buffer_lazy"])
    try:
        server.wait_ready()
        batch(server.base_url, n, 8, kinds["constrained"])  # warm-up (and the grammar's compile)
        rates: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(args.rounds):
            for name, flags in kinds.items():
                rates[name].append(batch(server.base_url, n, args.tokens, flags))
    finally:
        server.stop()
    plain = statistics.median(rates["plain"])
    row = {"requests": n, "tokens": args.tokens, "plain tok/s": round(plain, 1)}
    for name in ("constrained", "half constrained"):
        rate = statistics.median(rates[name])
        row[f"{name} tok/s"] = round(rate, 1)
        row[f"{name} / plain"] = round(rate / plain, 3)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
