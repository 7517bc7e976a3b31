"""What one huge request does to everyone else: /health latency and the pace of a concurrent stream
while a server receives, parses and tokenizes a large prompt.

    python benchmark/bench_huge_request.py --url http://127.0.0.1:30000 --mb 10

Start the server with a body limit above the prompt (`--max-request-body-size 33554432`) to measure
tokenization; with the default limit the request is refused (413) before its body is read. A stream
of `--stream-tokens` tokens runs first alone (its baseline pace), then again beside the huge request,
while /health is polled every 20 ms.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import requests


def stream_gaps(url: str, tokens: int) -> list[float]:
    """Seconds between consecutive SSE events of one /generate stream."""
    body = {
        "input_ids": [5, 6, 7],
        "stream": True,
        "sampling_params": {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 0},
    }
    gaps, last = [], None
    with requests.post(url + "/generate", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    return gaps


def poll_health(url: str, stop: threading.Event, out: list[float]) -> None:
    with requests.Session() as s:
        while not stop.is_set():
            t = time.perf_counter()
            s.get(url + "/health", timeout=60)
            out.append(time.perf_counter() - t)
            time.sleep(0.02)


def huge_request(url: str, mb: float, out: dict) -> None:
    text = "hello world, this is a test of tokenization. "
    prompt = text * int(mb * 1e6 / len(text))
    t = time.perf_counter()
    try:
        r = requests.post(url + "/generate", json={"text": prompt}, timeout=600)
        out["status"] = r.status_code
        out["message"] = r.text[:160]
    except requests.RequestException as e:
        out["status"] = type(e).__name__
    out["seconds"] = time.perf_counter() - t


def summary(name: str, values: list[float]) -> str:
    ms = sorted(v * 1000 for v in values)
    if not ms:
        return f"{name}: no samples"
    p50, p99 = statistics.median(ms), ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return f"{name}: n={len(ms)} p50={p50:.1f} ms p99={p99:.1f} ms max={ms[-1]:.1f} ms"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="http://127.0.0.1:30000")
    p.add_argument("--mb", type=float, default=10.0)
    p.add_argument("--stream-tokens", type=int, default=300)
    args = p.parse_args()

    print(summary("stream gaps alone", stream_gaps(args.url, args.stream_tokens)))
    health_alone: list[float] = []
    stop = threading.Event()
    poller = threading.Thread(target=poll_health, args=(args.url, stop, health_alone))
    poller.start()
    time.sleep(1.0)
    stop.set()
    poller.join()
    print(summary("/health alone", health_alone))

    health: list[float] = []
    stop = threading.Event()
    result: dict = {}
    poller = threading.Thread(target=poll_health, args=(args.url, stop, health))
    big = threading.Thread(target=huge_request, args=(args.url, args.mb, result))
    poller.start()
    gaps: list[float] = []
    streamer = threading.Thread(target=lambda: gaps.extend(stream_gaps(args.url, args.stream_tokens)))
    streamer.start()
    time.sleep(0.3)
    big.start()
    big.join()
    streamer.join()
    stop.set()
    poller.join()
    print(f"{args.mb:g} MB request: status {result.get('status')} after {result.get('seconds', 0):.2f} s")
    print(summary("/health during", health))
    print(summary("stream gaps during", gaps))


if __name__ == "__main__":
    main()
