"""TTFT of a prompt sent cold, then repeated exactly, and of the same prompt plus one token, on one server
per strategy in one run; with each, the cached tokens the server reports.

    .venv/bin/python benchmark/bench_exact_repeat.py [--tokens 2048] [--rounds 5] [--disk]

An exact repeat of an L-token prompt can use a checkpoint at most at L-1 (the last token's logits must
be computed); the prompt checkpoints at (L-1)//C*C and L//C*C make it hit (L-1)//C*C tokens.

--disk: the server has the host tier and the `file` disk tier (write_through, a temporary folder), and
each round adds an exact repeat after /flush_cache (device and host emptied: it hits disk, through the
repeat point's state-only entry) and reports the bytes of the prompt's disk entries (its files in the
folder: the prompt end's whole entry and the repeat point's).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time

import requests

from sglang.srt.mem_cache.disk_tier import entry_name
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


def entry_bytes(folder: str, ids: list[int]) -> int:
    """The bytes of the disk tier's entry files for prefixes of `ids` (no namespace) under `folder`."""
    names = {entry_name(ids[:n], None) for n in range(1, len(ids) + 1)}
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(folder) for f in files
               if f.endswith(".pt") and f[:64] in names)  # fmt: skip


def run(strategy: str, args) -> dict:
    argv, env = ["--model-path", args.model, "--mamba-scheduler-strategy", strategy], {}
    scratch = tempfile.mkdtemp(prefix="bench_exact_repeat_")
    folder = os.path.join(scratch, strategy)
    if args.disk:
        argv += ["--enable-hierarchical-cache", "--hicache-storage-backend", "file"]
        env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = folder
    server = ServerProcess(argv, env=env)
    try:
        server.wait_ready()
        rows = {"cold": [], "exact repeat": [], "repeat + 1 token": []}
        if args.disk:
            rows["exact repeat after flush (disk)"] = []
        cached, disk_bytes = {}, []
        for r in range(args.rounds):
            rng = random.Random(r)
            ids = [rng.randrange(10, 500) for _ in range(args.tokens)]
            for name, prompt in (("cold", ids), ("exact repeat", ids), ("repeat + 1 token", ids + [7])):
                t, c = ttft(server.base_url, prompt)
                rows[name].append(t)
                cached[name] = c
            if args.disk:
                requests.post(server.base_url + "/flush_cache", timeout=60).raise_for_status()
                t, c = ttft(server.base_url, ids)
                rows["exact repeat after flush (disk)"].append(t)
                cached["exact repeat after flush (disk)"] = c
                disk_bytes.append(entry_bytes(folder, ids))
        out = {"strategy": strategy, "tokens": args.tokens}
        if args.disk:
            out["disk bytes of the prompt"] = int(statistics.median(disk_bytes))
        for name, times in rows.items():
            out[f"{name} ttft ms"] = round(statistics.median(times) * 1000, 1)
            out[f"{name} cached"] = cached[name]
        out["cold / exact repeat"] = round(
            statistics.median(rows["cold"]) / statistics.median(rows["exact repeat"]), 1
        )
        return out
    finally:
        server.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny-qwen3-next")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--strategies", default="extra_buffer_lazy,extra_buffer,no_buffer")
    parser.add_argument("--disk", action="store_true", help="With the host tier and the file disk tier.")
    args = parser.parse_args()
    for strategy in args.strategies.split(","):
        print(json.dumps(run(strategy, args)))


if __name__ == "__main__":
    main()
