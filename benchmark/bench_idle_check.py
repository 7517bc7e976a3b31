"""What an idle server costs, and what its idle check adds to the first token of a request that arrives
while it is idle: the production count check against the strict full walk
(SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE=1), on one server each, in one run.

    .venv/bin/python benchmark/bench_idle_check.py [--max-total-tokens N] [--requests 20]

Reports per mode: CPU used by the server's processes over an idle window (percent of one core), and
the median TTFT of streamed requests each sent after the server went idle. Then the count check's own
time on a scheduler whose tree holds the cached prompts (in-process), which is what "no check at all"
saves over it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import requests

from sglang.test.test_utils import ServerProcess

TICKS = os.sysconf("SC_CLK_TCK")


def _tree_pids(root: int) -> list[int]:
    pids, frontier = [root], [root]
    while frontier:
        pid = frontier.pop()
        try:
            with open(f"/proc/{pid}/task/{pid}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        pids += kids
        frontier += kids
    return pids


def _cpu_seconds(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime
        except OSError:
            pass
    return total / TICKS


def _ttft(base_url: str, prompt: str) -> float:
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}, "stream": True}
    start = time.perf_counter()
    with requests.post(base_url + "/generate", json=body, stream=True, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data:"):
                return time.perf_counter() - start
    raise RuntimeError("no streamed chunk")


def run_mode(strict: bool, args) -> dict:
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1" if strict else "0"}
    cmd = ["--model-path", args.model, "--max-total-tokens", str(args.max_total_tokens)]
    server = ServerProcess(cmd, env=env)
    try:
        server.wait_ready()
        # Fill the tree: cached prompts make the strict walk as long as it is in a warm server.
        for k in range(args.warm_prompts):
            _ttft(server.base_url, f"warm-up prompt {k} " + "lorem ipsum " * 150)
        time.sleep(1.0)
        pids = _tree_pids(server.proc.pid)
        c0, t0 = _cpu_seconds(pids), time.monotonic()
        time.sleep(args.idle_seconds)
        idle_cpu = (_cpu_seconds(pids) - c0) / (time.monotonic() - t0) * 100
        ttfts = []
        for k in range(args.requests):
            time.sleep(args.gap)  # the server goes idle (and checks) before each request
            ttfts.append(_ttft(server.base_url, f"question {k}: " + "dolor sit amet " * 60))
        return {
            "mode": "strict walk" if strict else "count check",
            "idle_cpu_percent_of_core": round(idle_cpu, 2),
            "ttft_median_ms": round(statistics.median(ttfts) * 1000, 2),
            "ttft_p90_ms": round(sorted(ttfts)[int(0.9 * (len(ttfts) - 1))] * 1000, 2),
        }
    finally:
        server.stop()


def count_check_cost(args) -> float:
    """Microseconds per count check on a scheduler holding the cached prompts of a warm server."""
    from sglang.srt.mem_cache.integrity import check_accounting
    from sglang.test.scheduler_harness import SchedulerHarness, token_ids

    h = SchedulerHarness(args.model, max_total_tokens=args.max_total_tokens)
    try:
        for k in range(args.warm_prompts):
            h.generate(token_ids(600, seed=k), max_new_tokens=1)
        s = h.sched
        n = 2000
        start = time.perf_counter()
        for _ in range(n):
            check_accounting(s.tree_cache, s.req_to_token_pool, s.token_allocator, s.live_requests())
        return (time.perf_counter() - start) / n * 1e6
    finally:
        h.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen3-next")
    parser.add_argument("--max-total-tokens", type=int, default=1_000_000)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--gap", type=float, default=0.3, help="Seconds of idleness before each request.")
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--warm-prompts", type=int, default=32)
    args = parser.parse_args()
    rows = [run_mode(False, args), run_mode(True, args)]
    for row in rows:
        print(json.dumps(row))
    fast, strict = rows
    print(
        f"TTFT at an idle server, strict walk / count check: {strict['ttft_median_ms'] / fast['ttft_median_ms']:.2f}x"
    )
    print(json.dumps({"count_check_us": round(count_check_cost(args), 2)}))


if __name__ == "__main__":
    main()
