"""Seconds from `python -m sglang.launch_server` to a healthy server (`/health` answers 200; the warm-up
request has run by then), median of `--reps` launches, one after the other:

    .venv/bin/python benchmark/bench_server_startup.py                 # the built-in model, 5 launches
    .venv/bin/python benchmark/bench_server_startup.py --reps 3 -- --model-path tiny-nemotron-h

Arguments after `--` go to the server. Each launch is stopped (SIGTERM) once healthy.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import requests

from sglang.test.test_utils import find_free_port


def time_to_healthy(server_args: list[str], timeout: float = 300.0) -> float:
    port = find_free_port()
    cmd = [sys.executable, "-m", "sglang.launch_server", "--host", "127.0.0.1", "--port", str(port), *server_args]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}: {' '.join(cmd)}")
            try:
                if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - start
            except requests.RequestException:
                pass
            time.sleep(0.02)
        raise RuntimeError(f"the server was not healthy within {timeout:.0f} s")
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("server_args", nargs="*", help="Flags for the server (after --).")
    args = parser.parse_args()
    times = [time_to_healthy(args.server_args) for _ in range(args.reps)]
    print(f"time to healthy, s: {' '.join(f'{t:.2f}' for t in times)}; median {statistics.median(times):.2f}")


if __name__ == "__main__":
    main()
