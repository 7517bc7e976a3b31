"""Scheduler benchmark (CPU, tiny preset):

1. per mamba strategy, at a fixed pool of --slots mamba slots and a queue of --requests requests:
   mamba slots held per running request (mean and peak over decode steps) and the peak number of
   requests running at once;
2. scheduler time per decode step with --running requests decoding: the host work of building the
   batch and processing its result (the forward itself excluded), without overlap so the two are
   apart. Two cases: steady (the same requests decode step after step) and churn (3 x --running
   requests with output lengths spread over 40-199 tokens, so requests finish and new ones are
   admitted between decode steps, as in serving; its decode steps of at least --running - 8
   requests are timed).

    python benchmark/bench_scheduler.py [--slots 64] [--requests 64] [--running 256]
                                        [--preset tiny-qwen3-next | tiny-nemotron-h]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from sglang.test.scheduler_harness import SchedulerHarness, token_ids

STRATEGIES = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]
PRESETS = ["tiny-qwen3-next", "tiny-nemotron-h"]


def slots_per_request(preset: str, strategy: str, slots: int, requests: int) -> dict:
    h = SchedulerHarness(
        preset,
        mamba_scheduler_strategy=strategy,
        max_mamba_cache_size=slots,
        max_running_requests=requests,
        mamba_track_interval=64,
    )
    sched, pool = h.sched, h.sched.req_to_token_pool
    shared = token_ids(100, seed=1)
    for k in range(requests):
        h.submit(shared + token_ids(20, seed=2 + k), max_new_tokens=150, return_logprob=False)
    per_req, peak_running = [], 0
    while sched.step():
        running = [r for r in sched.running if not r.finished]
        if running:
            held = sum(len(pool.mamba_slots_of(r)) for r in running)
            per_req.append(held / len(running))
            peak_running = max(peak_running, len(running))
    h.shutdown()
    return {"mean": statistics.mean(per_req), "peak": max(per_req), "peak_running": peak_running}


def _timing_harness(preset: str, running: int, strategy: str, tokens_per_request: int) -> SchedulerHarness:
    return SchedulerHarness(
        preset,
        mamba_scheduler_strategy=strategy,
        disable_overlap_schedule=True,
        max_running_requests=running,
        max_mamba_cache_size=4 * running,
        max_total_tokens=running * tokens_per_request,
        mamba_track_interval=64,
    )


def _timed_step(sched):
    """One step with its host parts apart: (batch, build s, forward s, process s); batch None: idle."""
    t0 = time.perf_counter()
    batch = sched.get_next_batch_to_run()
    t1 = time.perf_counter()
    if batch is None:
        return None, 0.0, 0.0, 0.0
    sched.launch(batch)
    _, fut = sched.in_flight[0]
    fut.result()
    t2 = time.perf_counter()
    sched.process_oldest()
    t3 = time.perf_counter()
    return batch, t1 - t0, t2 - t1, t3 - t2


def _medians(times: list[tuple[float, float, float]]) -> tuple[float, float, float]:
    return tuple(statistics.median(t[i] for t in times) for i in range(3))


def decode_step_time(preset: str, running: int, strategy: str) -> tuple[float, float, float]:
    h = _timing_harness(preset, running, strategy, 200)
    sched = h.sched
    for k in range(running):
        h.submit(token_ids(40, seed=k), max_new_tokens=60, return_logprob=False)
    while sched.waiting_queue or sched.chunked_req is not None:
        sched.step()  # prefill everyone first
    times = []
    for _ in range(30):
        batch, *t = _timed_step(sched)
        assert batch is not None and batch.batch_size == running and batch.forward_mode.is_decode()
        times.append(t)
    h.shutdown()
    return _medians(times)


def churn_decode_step_time(preset: str, running: int, strategy: str) -> tuple[float, float, float]:
    h = _timing_harness(preset, running, strategy, 400)
    for k in range(3 * running):
        h.submit(token_ids(40, seed=k), max_new_tokens=40 + (k * 37) % 160, return_logprob=False)
    times = []
    for step in range(400):
        batch, *t = _timed_step(h.sched)
        if batch is None:
            break
        if step >= 20 and batch.forward_mode.is_decode() and batch.batch_size >= running - 8:
            times.append(t)
    h.shutdown()
    assert len(times) >= 30, "too few full decode steps to time"
    return _medians(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--running", type=int, default=256)
    parser.add_argument("--preset", choices=PRESETS, default=PRESETS[0])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"{args.preset}, one torch thread")
    print(
        f"{args.requests} requests (120-token prompts, 150 outputs, track interval 64), {args.slots} mamba slots"
    )
    print(f"{'strategy':<18} {'slots/running req (mean, peak)':>30} {'peak running':>13}")
    for strategy in STRATEGIES:
        r = slots_per_request(args.preset, strategy, args.slots, args.requests)
        print(f"{strategy:<18} {r['mean']:>20.2f}, {r['peak']:>6.2f} {r['peak_running']:>13}")
    for case, timer in [("steady", decode_step_time), ("churn", churn_decode_step_time)]:
        print(f"\nscheduler host time per decode step at {args.running} running requests, {case} (medians):")
        for strategy in STRATEGIES:
            build, forward, process = timer(args.preset, args.running, strategy)
            share = (build + process) / forward
            print(
                f"{strategy:<18} build {build * 1e3:6.2f} ms   process {process * 1e3:6.2f} ms   "
                f"forward {forward * 1e3:6.2f} ms   host / forward {share:.1%}"
            )


if __name__ == "__main__":
    main()
