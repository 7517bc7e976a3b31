"""Prefill/decode disaggregation against a single server, on one machine (loopback): time to first token,
per-token latency and throughput through `sglang-router` (PD mode, a prefill and a decode server, Mooncake
TCP) against one plain server with the same flags; and the transfer engine's bandwidth for what one
request moves (its prompt's KV and its recurrent state).

    python benchmark/bench_pd.py                       # both presets, 512-token prompts, 32 new tokens
    python benchmark/bench_pd.py --preset tiny-qwen3-next --num-prompts 32 --input-len 1024
    python benchmark/bench_pd.py --device cuda        # CUDA pools on one GPU (run_gpu_checks.sh pd_gpu)

On CUDA all three servers share the GPU with fixed pools (65,536 tokens, 64 mamba slots: a few MB of the
tiny presets; without both sizes each server's budget would be measured against the others' memory)
and the pair moves its KV and state through pinned host buffers (disaggregation/staging.py) unless
Mooncake's CUDA build is installed: `transfer_path` says which.

Sequential requests alternate between the two targets (so machine noise hits both alike); each prompt is
fresh random tokens (no cache hits). Medians; ratios are PD over single.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from sglang.srt.configs.presets import resolve_model_path
from sglang.test.router_process import start_pd, stop_all
from sglang.test.test_utils import ServerProcess


def stream_one(url: str, ids: list[int], output_len: int) -> dict:
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    first = last = None
    n = 0
    with requests.post(url + "/generate", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            now = time.perf_counter()
            n = len(json.loads(line[6:])["output_ids"])
            if first is None and n:
                first = now
            last = now
    assert n == output_len, f"{n} tokens instead of {output_len}"
    return {"ttft": first - start, "itl": (last - first) / max(n - 1, 1), "e2e": last - start}


def concurrent_throughput(url: str, prompts: list[list[int]], output_len: int) -> float:
    start = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        list(pool.map(lambda ids: stream_one(url, ids, output_len), prompts))
    return len(prompts) * output_len / (time.perf_counter() - start)


def bench_preset(preset: str, args) -> dict:
    path = resolve_model_path(preset)
    rng = random.Random(0)

    def prompt() -> list[int]:
        return [rng.randrange(3, 500) for _ in range(args.input_len)]

    gpu = ["--device", "cuda", "--max-total-tokens", "65536", "--max-mamba-cache-size", "64"] if args.device == "cuda" else []
    single = ServerProcess(["--model-path", path, *gpu])
    prefill = decode = router = None
    try:
        single.wait_ready()
        prefill, decode, router, _ = start_pd(path, gpu, gpu)
        path_used = "staged" if "through a" in decode.log_text() else "direct"
        targets = {"single": single.base_url, "pd": router.base_url}
        for url in targets.values():  # warm up
            stream_one(url, prompt(), 4)
        before = requests.get(decode.base_url + "/get_server_info", timeout=10).json()
        before = before["internal_states"][0]["disaggregation"]
        rows = {name: [] for name in targets}
        for _ in range(args.num_prompts):
            for name, url in targets.items():
                rows[name].append(stream_one(url, prompt(), args.output_len))
        after = requests.get(decode.base_url + "/get_server_info", timeout=10).json()
        after = after["internal_states"][0]["disaggregation"]
        tput = {name: concurrent_throughput(url, [prompt() for _ in range(args.concurrency)], args.output_len)
                for name, url in targets.items()}  # fmt: skip
    finally:
        stop_all(router, decode, prefill, single)

    def med(name: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[name])

    moved = after["bytes"] - before["bytes"]
    n = after["transfers"] - before["transfers"]
    seconds = after["seconds"] - before["seconds"]
    return {
        "preset": preset,
        "device": args.device,
        "transfer_path": path_used,
        **{f"{k}_ms_{name}": 1000 * med(name, k) for k in ("ttft", "itl", "e2e") for name in rows},
        **{f"throughput_{name}": tput[name] for name in tput},
        "bytes_per_request": moved / max(n, 1),
        "transfer_ms_per_request": 1000 * seconds / max(n, 1),
        "transfer_gb_per_s": moved / seconds / 1e9 if seconds else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", action="append", help="default: both tiny presets")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    presets = args.preset or ["tiny-qwen3-next", "tiny-nemotron-h"]
    results = [bench_preset(p, args) for p in presets]
    print(f"\n{args.num_prompts} sequential + {args.concurrency} concurrent requests, "
          f"{args.input_len} prompt tokens, {args.output_len} new tokens; medians (PD / single)")  # fmt: skip
    print("| preset | TTFT single | TTFT PD | ratio | ITL single | ITL PD | ratio | tok/s single | tok/s PD | "
          "KB moved / req | transfer ms / req | GB/s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['preset']} | {r['ttft_ms_single']:.1f} ms | {r['ttft_ms_pd']:.1f} ms | "
            f"{r['ttft_ms_pd'] / r['ttft_ms_single']:.2f} | {r['itl_ms_single']:.2f} ms | {r['itl_ms_pd']:.2f} ms | "
            f"{r['itl_ms_pd'] / r['itl_ms_single']:.2f} | {r['throughput_single']:.0f} | {r['throughput_pd']:.0f} | "
            f"{r['bytes_per_request'] / 1024:.0f} | {r['transfer_ms_per_request']:.2f} | {r['transfer_gb_per_s']:.2f} |"
        )


if __name__ == "__main__":
    main()
