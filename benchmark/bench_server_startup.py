"""Seconds from `python -m sglang.launch_server` to a healthy server (`/health` answers 200; the warm-up
has run by then), median of `--reps` launches, one after the other, with where the last one's start went:

    .venv/bin/python benchmark/bench_server_startup.py                 # the built-in model, 5 launches
    .venv/bin/python benchmark/bench_server_startup.py --reps 3 -- --model-path tiny-nemotron-h

With `--serving-runs 2` the last launch then serves `sglang.bench_serving` twice (the same requests, the
cache flushed before each, no bench warm-up request) and prints each run's output throughput and the
first / second ratio: a first run slower than the second paid one-time costs (kernel compiles and
autotuning) the server's warm-up left to it. It also counts the kernels Triton compiled after ready:
new compiled-kernel entries (and flash-linear-attention autotune results) in Triton's cache folder
(TRITON_CACHE_DIR, else ~/.triton/cache) during each run; and the kernels first used after ready,
compiled or loaded from that cache (the server runs with SGLANG_LOG_TRITON_FIRST_USE=1: on an H200 the
first run was 0.784x the second with nothing compiled, a cache warm from an earlier benchmark). It
prints the last start's log lines as seconds after the launch. Nothing compiles on a CPU. On a GPU:

    python benchmark/bench_server_startup.py --reps 1 --serving-runs 2 -- --model-path 147m --device cuda

Arguments after `--` go to the server (`--bench-args` to bench_serving). Each launch is stopped
(SIGTERM) at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

from sglang.test.test_utils import find_free_port

BENCH_ARGS = "--num-prompts 64 --random-input-len 1024 --random-output-len 128 --max-concurrency 32"


class Server:
    """One launch, its log in a file; `healthy_s`: seconds from the launch to `/health` 200."""

    def __init__(self, server_args: list[str], log_path: Path, timeout: float = 600.0):
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [
            sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(self.port),
            *server_args,
        ]  # fmt: skip
        start = time.perf_counter()
        self.launched_wall = time.time()
        # Each Triton kernel's first use in the server's processes is logged (compiled, or loaded from
        # the disk cache: both cost, only compiles leave new files): `first_uses` counts them after ready.
        env = {**os.environ, "SGLANG_LOG_TRITON_FIRST_USE": "1"}
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while time.perf_counter() - start < timeout:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited with {self.proc.returncode}: {self.log_tail()}")
                try:
                    if requests.get(f"{self.url}/health", timeout=1).status_code == 200:
                        self.healthy_s = time.perf_counter() - start
                        return
                except requests.RequestException:
                    pass
                time.sleep(0.02)
            raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")
        except BaseException:
            self.stop()
            raise

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_breakdown(server: Server) -> dict[str, float]:
    """Where a start went, in seconds: the scheduler's phases (`startup_times`: load_weight,
    kv_cache_allocation, cuda_graph) and the warm-up's (from the log)."""
    info = requests.get(f"{server.url}/get_server_info", timeout=30).json()
    times = dict((info.get("internal_states") or [{}])[0].get("startup_times") or {})
    log = server.log_path.read_text(errors="replace")
    for key, pattern in (("warmup_request", r"Warm-up request done in ([\d.]+) s"),
                         ("shape_warmup", r"Shape warm-up done in ([\d.]+) s")):  # fmt: skip
        found = re.search(pattern, log)
        if found:
            times[key] = float(found.group(1))
    return times


LOG_TIME = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3})[ \]]")


def log_timeline(server: Server, most: int = 40) -> list[str]:
    """The server log's timestamped lines up to healthy, each as seconds after the launch: where a start
    went outside the scheduler's own phases (imports, process starts, tokenizer, warm-ups)."""
    out = []
    for line in server.log_path.read_text(errors="replace").splitlines():
        found = LOG_TIME.match(line)
        if not found:
            continue
        wall = time.mktime(time.strptime(found.group(1), "%Y-%m-%d %H:%M:%S")) + int(found.group(2)) / 1e3
        after = wall - server.launched_wall
        if after > server.healthy_s + 1:
            break
        out.append(f"  {after:7.2f} {line[found.end():].strip()[:150]}")
    return out[:most] + [f"  {server.healthy_s:7.2f} /health answered 200"]


FIRST_USE = re.compile(r"Triton first use: (\S+)")


def first_uses(server: Server, offset: int) -> tuple[list[str], int]:
    """The kernels the server's log says were first used after byte `offset` of it, and its new end."""
    with open(server.log_path, "rb") as f:
        f.seek(offset)
        text = f.read()
    return FIRST_USE.findall(text.decode(errors="replace")), offset + len(text)


def triton_cache_dir() -> Path:
    return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def new_cache_entries(since: float) -> tuple[list[str], int]:
    """Kernels Triton compiled since `since` (time.time()): the names of the metadata files it writes
    beside each compiled kernel, and how many autotune results (`*.autotune.json`) appeared."""
    kernels, autotunes = [], 0
    root = triton_cache_dir()
    if not root.is_dir():
        return kernels, autotunes
    for path in root.rglob("*.json"):
        try:
            if path.stat().st_mtime < since:
                continue
        except FileNotFoundError:
            continue
        if path.name.endswith(".autotune.json"):
            autotunes += 1
        elif not path.name.startswith("__grp__"):
            kernels.append(path.stem)
    return sorted(kernels), autotunes


def serve_once(server: Server, bench_args: list[str]) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as out:
        cmd = [
            sys.executable, "-m", "sglang.bench_serving", "--port", str(server.port), "--warmup-requests", "0",
            "--flush-cache", "--disable-tqdm", "--output-file", out.name, *bench_args,
        ]  # fmt: skip
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--serving-runs", type=int, default=0, help="bench_serving runs on the last launch.")
    parser.add_argument("--bench-args", default=BENCH_ARGS, help="bench_serving's arguments (one string).")
    parser.add_argument("server_args", nargs="*", help="Flags for the server (after --).")
    args = parser.parse_args()
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            server = Server(args.server_args, Path(tmp) / f"server-{rep}.log")
            try:
                times.append(server.healthy_s)
                if rep < args.reps - 1:
                    continue
                parts = start_breakdown(server)
                print("last start, s: " + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()))
                print("last start's log, s after the launch:", *log_timeline(server), sep="\n")
                runs = []
                _, offset = first_uses(server, 0)
                for run in range(args.serving_runs):
                    since = time.time()
                    result = serve_once(server, shlex.split(args.bench_args))
                    kernels, autotunes = new_cache_entries(since)
                    used, offset = first_uses(server, offset)
                    runs.append(result["output_throughput"])
                    shown = ", ".join(kernels[:8]) + (" ..." if len(kernels) > 8 else "")
                    print(
                        f"serving run {run + 1}: {result['output_throughput']:.1f} output tok/s, "
                        f"{result['duration']:.2f} s, median TTFT {result['median_ttft_ms']:.1f} ms, median ITL "
                        f"{result['median_itl_ms']:.2f} ms; compiled after ready: {len(kernels)} kernel(s)"
                        f"{' (' + shown + ')' if kernels else ''}, {autotunes} autotune result(s); first used "
                        f"after ready (compiled or loaded): {len(used)}"
                        + (f" ({', '.join(sorted(set(used))[:8])})" if used else "")
                    )
                if len(runs) >= 2:
                    print(f"first / second run throughput: {runs[0] / runs[1]:.3f}")
            finally:
                server.stop()
    shown = " ".join(f"{t:.2f}" for t in times)
    print(f"time to healthy, s: {shown}; median {statistics.median(times):.2f}")


if __name__ == "__main__":
    main()
