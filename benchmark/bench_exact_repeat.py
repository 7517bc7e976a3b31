"""TTFT of a prompt sent cold, then repeated exactly, and of the same prompt plus one token, on one server
per strategy in one run; with each, the cached tokens the server reports.

    .venv/bin/python benchmark/bench_exact_repeat.py [--tokens 2048] [--rounds 5]

An exact repeat of an L-token prompt can use a checkpoint at most at L-1 (the last token's logits must
be computed); the prompt checkpoints at (L-1)//C*C and L//C*C make it hit (L-1)//C*C tokens.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import requests

from sglang.test.test_utils import ServerProcess


def ttft(base_url: str, ids: list[int], output_ids: list[int] | None = None) -> tuple[float, int]:
    """(seconds to the first streamed chunk, cached tokens) of one 2-token greedy request; the output ids
    are appended to `output_ids` if given."""
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "stream": True}
    start = time.perf_counter()
    first, cached, chunk = None, None, {}
    with requests.post(base_url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:") or line == b"data: [DONE]":
                continue
            first = first or time.perf_counter() - start
            chunk = json.loads(line[5:])
            cached = chunk["meta_info"].get("cached_tokens", cached)
    if output_ids is not None:
        output_ids.extend(chunk.get("output_ids", []))
    return first, cached


def run(strategy: str, args) -> dict:
    server = ServerProcess(["--model-path", args.model, "--mamba-scheduler-strategy", strategy])
    try:
        server.wait_ready()
        rows = {"cold": [], "exact repeat": [], "repeat + 1 token": []}
        cached = {}
        for r in range(args.rounds):
            rng = random.Random(r)
            ids = [rng.randrange(10, 500) for _ in range(args.tokens)]
            for name, prompt in (("cold", ids), ("exact repeat", ids), ("repeat + 1 token", ids + [7])):
                t, c = ttft(server.base_url, prompt)
                rows[name].append(t)
                cached[name] = c
        out = {"strategy": strategy, "tokens": args.tokens}
        for name, times in rows.items():
            out[f"{name} ttft ms"] = round(statistics.median(times) * 1000, 1)
            out[f"{name} cached"] = cached[name]
        out["cold / exact repeat"] = round(
            statistics.median(rows["cold"]) / statistics.median(rows["exact repeat"]), 1
        )
        return out
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen3-next")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategies", default="extra_buffer_lazy,extra_buffer,no_buffer")
    args = parser.parse_args()
    for strategy in args.strategies.split(","):
        print(json.dumps(run(strategy, args)))


if __name__ == "__main__":
    main()
