"""What a request's stop strings do to everyone else: each case posts one request (streamed or not) while
a victim sends an 8-token greedy /generate every 0.25 s, and prints the request's status and seconds and
the victim's max and median latency.

    python benchmark/bench_stop_strings.py --url http://127.0.0.1:30000            # every case
    python benchmark/bench_stop_strings.py --url http://127.0.0.1:30000 --cases bound_stream_256

The cases: the security review's (2026-11-29) two repros, refused now (`review_stream`: one stream with
30,000 stop strings; `review_sched`: 8 prompts x n 8 x 200 tokens with 25,000 strings and one of
200,000 characters), the same shapes at the bounds of `constrained/stop_strings.py` (256 strings of
~62 characters, 16 of 1,024), and the same without stops.
"""

from __future__ import annotations

import argparse
import json
import random
import threading
import time

import requests

rnd = random.Random(0)


def words(n: int, k: int) -> list[str]:
    return ["".join(rnd.choice("qzxjvkw") for _ in range(k)) + str(i) for i in range(n)]


def sampling(n: int, tokens: int, stop: list[str] | None) -> dict:
    params = {"n": n, "max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
    return {**params, "stop": stop} if stop is not None else params


PROMPTS = [f"def hello {i}" for i in range(8)]
LONG16 = ["Q" * 1020 + str(1000 + i) for i in range(16)]
CASES = {  # name: (streamed, sampling_params, prompt)
    "review_stream": (True, sampling(1, 50, words(30000, 12)), "def hello"),
    "review_sched": (False, sampling(8, 200, words(25000, 12) + ["Q" * 200000]), PROMPTS),
    "nostop_stream": (True, sampling(16, 300, None), "def hello"),
    "bound_stream_256": (True, sampling(16, 300, words(256, 60)), "def hello"),
    "bound_stream_16x1024": (True, sampling(16, 300, LONG16), "def hello"),
    "nostop_sched": (False, sampling(8, 200, None), PROMPTS),
    "bound_sched_256": (False, sampling(8, 200, words(256, 60)), PROMPTS),
    "bound_sched_16x1024": (False, sampling(8, 200, LONG16), PROMPTS),
}


def victim(url: str, stop: threading.Event, latencies: list[float]) -> None:
    i = 0
    while not stop.is_set():
        t0 = time.time()
        body = {"text": f"The victim asks {i}", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        requests.post(url + "/generate", json=body, timeout=600)
        latencies.append(time.time() - t0)
        i += 1
        time.sleep(0.25)


def run(url: str, name: str) -> dict:
    streamed, params, prompt = CASES[name]
    stop, latencies = threading.Event(), []
    thread = threading.Thread(target=victim, args=(url, stop, latencies))
    thread.start()
    time.sleep(1.0)
    t0 = time.time()
    body = {"text": prompt, "stream": streamed, "sampling_params": params}
    r = requests.post(url + "/generate", stream=streamed, json=body, timeout=900)
    received = sum(len(c) for c in r.iter_content(65536))
    seconds = time.time() - t0
    time.sleep(0.5)
    stop.set()
    thread.join()
    latencies.sort()
    return {
        "case": name,
        "status": r.status_code,
        "s": round(seconds, 2),
        "bytes": received,
        "victim_max_s": round(latencies[-1], 3),
        "victim_median_s": round(latencies[len(latencies) // 2], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    args = parser.parse_args()
    for name in args.cases:
        print(json.dumps(run(args.url, name)), flush=True)


if __name__ == "__main__":
    main()
