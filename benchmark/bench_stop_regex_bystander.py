"""What costly stop_regex requests do to a bystander: `--clients` concurrent greedy requests of
`--tokens` tokens (ignore_eos) whose stop_regex backtracks a lot on every check (the security review's
pattern, 2026-11-29 row 4) while a bystander sends an 8-token greedy /generate every 0.25 s. Prints the
requests' statuses, the seconds until all ended, the bystander's max and median latency, and the
server's speculative counters (/get_server_info) where it has them. Run it against a server with and
without `--speculative-algorithm NGRAM` (each committed token of a verify is checked).

    python -m sglang.launch_server --model-path tiny-qwen3-next --port 30000 \\
        --speculative-algorithm NGRAM --speculative-num-draft-tokens 4 &
    python benchmark/bench_stop_regex_bystander.py --url http://127.0.0.1:30000   # --clients 16 --tokens 150

Each client's prompt is first generated once without the pattern (all at once, before the bystander
starts): NGRAM's cache then holds each output, and the clients' drafts are accepted (the tiny model's
greedy text is otherwise predicted ~1% of the time). (`--force-token` biases one token instead; it also
turns NGRAM's drafts off: a logit_bias is a penalty, `penalized_now`.)
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections import Counter

import requests
from bench_stop_strings import victim  # (benchmark/, the script's folder, is on sys.path)

PATTERN = r"(?:[\s\S]{1,60}){1,2}(?!)"

# (the stop strings benchmark's victim: an 8-token greedy /generate every 0.25 s, its latencies)
bystander = victim


def client(url: str, k: int, tokens: int, pattern: str | None, force: int | None, statuses: list) -> None:
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    if pattern is not None:
        params["stop_regex"] = pattern
    if force is not None:
        params["logit_bias"] = {str(force): 100}
    body = {"text": f"def hello {k}", "sampling_params": params}
    r = requests.post(url + "/generate", json=body, timeout=900)
    statuses.append(r.status_code)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:30000")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--pattern", default=PATTERN)
    parser.add_argument(
        "--force-token", type=int, default=None, help="a token id logit_bias makes the requests repeat"
    )
    args = parser.parse_args()
    warm: list[int] = []
    threads = [
        threading.Thread(target=client, args=(args.url, k, args.tokens, None, args.force_token, warm))
        for k in range(args.clients)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop, latencies, statuses = threading.Event(), [], []
    watcher = threading.Thread(target=bystander, args=(args.url, stop, latencies))
    watcher.start()
    time.sleep(1.0)
    t0 = time.time()
    run = (args.url, args.tokens, args.pattern, args.force_token, statuses)
    threads = [threading.Thread(target=client, args=(run[0], k, *run[1:])) for k in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seconds = time.time() - t0
    time.sleep(0.5)
    stop.set()
    watcher.join()
    latencies.sort()
    info = requests.get(args.url + "/get_server_info", timeout=60).json()  # (the warm-up's counts included)
    spec = next((s.get("speculative") for s in info.get("internal_states", []) if "speculative" in s), None)
    print(
        json.dumps(
            {
                "statuses": dict(Counter(statuses)),
                "s": round(seconds, 2),
                "bystander_max_s": round(latencies[-1], 3),
                "bystander_median_s": round(latencies[len(latencies) // 2], 3),
                "bystander_requests": len(latencies),
                "speculative": spec,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
