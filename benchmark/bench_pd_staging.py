"""The staged PD path's chunking (disaggregation/staging.py): what moving a request in several chunks
through fixed-size staging buffers costs against one chunk. One PD pair per chunk size behind the router
(SGLANG_DISAGGREGATION_STAGING=1 on CPU pools, loopback, Mooncake TCP); each request's transfer time is
the prefill server's (packing, writes, and the decode server's unpack and acknowledgement of every chunk
but the last). Medians over sequential requests of fresh random prompts; the ratio is against the
largest chunk (the whole request in one).

    python benchmark/bench_pd_staging.py
    python benchmark/bench_pd_staging.py --input-len 4000 --chunks-mib 4 0.25 0.05 --num-prompts 12
    python benchmark/bench_pd_staging.py --chunks-mib 4 --prefill-tp 2 --decode-tp 1   # between TP sizes
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import requests

from sglang.srt.configs.presets import resolve_model_path
from sglang.test.router_process import start_pd, stop_all


def disagg(server) -> dict:
    return requests.get(server.base_url + "/get_server_info", timeout=10).json()["internal_states"][0][
        "disaggregation"
    ]


def run(path: str, chunk_mib: float, input_len: int, num_prompts: int, seed: int, tp: tuple[int, int],
        direct: bool = False) -> dict:  # fmt: skip
    env = {"SGLANG_DISAGGREGATION_STAGING": "0" if direct else "1",
           "SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": str(chunk_mib),
           "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": str(4 * chunk_mib)}  # fmt: skip
    prefill, decode, router, _ = start_pd(path, ["--tp-size", str(tp[0])], ["--tp-size", str(tp[1])], env, env)
    try:
        rng = random.Random(seed)
        times, chunks = [], []
        for _ in range(num_prompts):
            ids = [rng.randrange(3, 500) for _ in range(input_len)]
            p0, d0 = disagg(prefill), disagg(decode)
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
            requests.post(router.base_url + "/generate", json=body, timeout=300).raise_for_status()
            p1, d1 = disagg(prefill), disagg(decode)
            times.append(1000 * (p1["seconds"] - p0["seconds"]))
            chunks.append(d1["staged_chunks"] - d0["staged_chunks"])
        return {"tp": f"{tp[0]} -> {tp[1]}", "path": "direct" if direct else "staged", "chunk_mib": chunk_mib,
                "chunks_per_request": statistics.median(chunks),
                "transfer_ms": statistics.median(times), "bytes_per_request": p1["bytes"] // p1["transfers"]}  # fmt: skip
    finally:
        stop_all(router, decode, prefill)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny-qwen3-next")
    parser.add_argument("--input-len", type=int, default=3000)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--chunks-mib", type=float, nargs="+", default=[4.0, 0.1, 0.02])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-tp", type=int, default=1, help="the prefill server's --tp-size")
    parser.add_argument("--decode-tp", type=int, default=1, help="the decode server's --tp-size")
    parser.add_argument("--direct", action="store_true", help="the direct path (pools registered as they are) "
                        "instead of staging: one row per chunk size")  # fmt: skip
    args = parser.parse_args()
    path = resolve_model_path(args.preset)
    tp = (args.prefill_tp, args.decode_tp)
    rows = [run(path, c, args.input_len, args.num_prompts, args.seed, tp, args.direct) for c in args.chunks_mib]
    base = rows[0]["transfer_ms"]
    for r in rows:
        r["ratio"] = r["transfer_ms"] / base if base else 0.0
        extra = r["chunks_per_request"] - rows[0]["chunks_per_request"]
        r["ms_per_extra_chunk"] = (r["transfer_ms"] - base) / extra if extra else 0.0
        print(json.dumps(r))


if __name__ == "__main__":
    main()
