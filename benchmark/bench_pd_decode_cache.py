"""What a conversation's next turn moves between the PD servers, with the decode server's radix cache
(--disaggregation-decode-enable-radix-cache) against without: KV tokens, bytes and transfer time per turn,
from the prefill server's `/get_server_info`, and the turn's latency through the router. Each turn's
prompt is the previous prompt, its answer and `--new-len` new tokens (greedy).

    python benchmark/bench_pd_decode_cache.py                      # tiny-nemotron-h, 4 turns
    python benchmark/bench_pd_decode_cache.py --preset tiny-qwen3-next --first-len 1000 --turns 6
"""

from __future__ import annotations

import argparse
import json
import random
import time

import requests

from sglang.srt.configs.presets import resolve_model_path
from sglang.test.router_process import start_pd, stop_all


def disagg(server) -> dict:
    info = requests.get(server.base_url + "/get_server_info", timeout=10).json()
    return info["internal_states"][0]["disaggregation"]


def run(model: str, cache: bool, args) -> list[dict]:
    env = {"SGLANG_DISAGGREGATION_SECRET": "bench"}
    decode_args = ["--disaggregation-decode-enable-radix-cache"] if cache else []
    prefill, decode, router, _ = start_pd(model, [], decode_args, env, env)
    rng = random.Random(0)
    ids = [rng.randrange(3, 400) for _ in range(args.first_len)]
    rows = []
    try:
        for turn in range(args.turns):
            if turn:
                ids = ids + [rng.randrange(3, 400) for _ in range(args.new_len)]
            before = disagg(prefill)
            start = time.perf_counter()
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": args.output_len, "temperature": 0,
                                                          "ignore_eos": True}}  # fmt: skip
            r = requests.post(router.base_url + "/generate", json=body, timeout=300)
            r.raise_for_status()
            latency = time.perf_counter() - start
            after = disagg(prefill)
            rows.append({
                "turn": turn + 1, "prompt": len(ids),
                "kv_tokens": after["kv_tokens"] - before["kv_tokens"],
                "bytes": after["bytes"] - before["bytes"],
                "transfer_ms": 1e3 * (after["seconds"] - before["seconds"]),
                "latency_ms": 1e3 * latency,
            })  # fmt: skip
            ids = ids + r.json()["output_ids"]
    finally:
        stop_all(prefill, decode, router)
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="tiny-nemotron-h")
    p.add_argument("--first-len", type=int, default=500)
    p.add_argument("--new-len", type=int, default=50)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--turns", type=int, default=4)
    args = p.parse_args()
    model = resolve_model_path(args.preset)
    for cache in (False, True):
        for row in run(model, cache, args):
            print(json.dumps({"preset": args.preset, "decode_cache": cache, **row}))


if __name__ == "__main__":
    main()
