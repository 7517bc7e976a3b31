"""Slots per running request under a small mamba pool (issue 61), CPU, in-process scheduler:
--requests requests sharing a --prefix-token prefix (plus 16 tokens of their own), --new-tokens output
tokens each, at --max-mamba-cache-size --slots and a running cap (--max-running-requests) as large as
the queue, so the pool alone bounds how many run at once (--max-running-requests 0: the cap derived
from the pool, which leaves the tree its headroom). Reports, per strategy:

- peak running: the most requests running at once;
- slots per running request: mamba slots held by requests over running requests, averaged over the
  steps while requests wait in the queue (mean), and its peak;
- cached tokens: the mean of the requests' `cached_tokens` (the shared prefix is hit at 512);
- tree slots: the mean number of checkpoints the tree holds over those steps;
- lazy_alloc_failures (extra_buffer_lazy): boundaries whose first slot allocation failed, and those
  whose retry after evicting a checkpoint failed too (the snapshot skipped).

    python benchmark/bench_slots_per_request.py [--slots 64] [--requests 128] [--prefix 512]
                                               [--new-tokens 256] [--mamba-track-interval 256]
                                               [--max-running-requests N]
                                               [--strategies extra_buffer_lazy ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sglang.test.scheduler_harness import SchedulerHarness, token_ids


def run(
    strategy: str,
    slots: int,
    requests: int,
    prefix: int,
    new_tokens: int,
    overlap: bool,
    interval: int,
    max_running: int | None,
) -> dict:
    h = SchedulerHarness(
        "tiny-qwen3-next",
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=not overlap,
        max_mamba_cache_size=slots,
        max_running_requests=requests if max_running is None else max_running or None,
        max_total_tokens=requests * (prefix + 16 + new_tokens) + 4096,
        mamba_track_interval=interval,
    )
    sched, pool, tree = h.sched, h.sched.req_to_token_pool, h.sched.tree_cache
    shared = token_ids(prefix, seed=1)
    rids = [
        h.submit(shared + token_ids(16, seed=2 + k), max_new_tokens=new_tokens, return_logprob=False)
        for k in range(requests)
    ]
    per_req, tree_slots, peak_running, steps = [], [], 0, 0
    t0 = time.perf_counter()
    while sched.step():
        steps += 1
        running = [r for r in sched.running if not r.finished]
        peak_running = max(peak_running, len(running))
        if running and sched.waiting_queue:
            per_req.append(sum(len(pool.mamba_slots_of(r)) for r in running) / len(running))
            tree_slots.append(tree.mamba_total_size())
    elapsed = time.perf_counter() - t0
    failures = sched.get_internal_state().get("lazy_alloc_failures")
    h.collect()
    cached = [h.outputs[r].cached_tokens for r in rids]
    assert all(len(h.outputs[r].output_ids) == new_tokens for r in rids)
    h.shutdown()
    return {
        "strategy": strategy,
        "overlap": overlap,
        "peak_running": peak_running,
        "mean_slots_per_running_req": round(statistics.mean(per_req), 3) if per_req else None,
        "peak_slots_per_running_req": round(max(per_req), 3) if per_req else None,
        "mean_cached_tokens": round(statistics.mean(cached), 1),
        "mean_tree_slots": round(statistics.mean(tree_slots), 1) if tree_slots else None,
        "lazy_alloc_failures": failures if strategy == "extra_buffer_lazy" else None,
        "steps": steps,
        "seconds": round(elapsed, 1),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--requests", type=int, default=128)
    p.add_argument("--prefix", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--strategies", nargs="+", default=["extra_buffer_lazy", "extra_buffer", "no_buffer"])
    p.add_argument("--mamba-track-interval", type=int, default=256)
    p.add_argument(
        "--max-running-requests", type=int, default=None, help="default: --requests; 0: the derived cap"
    )
    p.add_argument("--disable-overlap-schedule", action="store_true")
    a = p.parse_args()
    for s in a.strategies:
        overlap = not a.disable_overlap_schedule
        args = (a.slots, a.requests, a.prefix, a.new_tokens, overlap, a.mamba_track_interval)
        print(json.dumps(run(s, *args, a.max_running_requests)))


if __name__ == "__main__":
    main()
