"""--enable-mixed-chunk against plain chunked prefill, CPU, in-process scheduler: --decoders requests
(--decoder-prompt tokens, --new-tokens out, streamed) decode; after --warm steps --long prompts of
--long-tokens arrive and are prefilled in chunks of --chunk while the decoders run. Reports per mode,
over the window from the long prompts' arrival until they are prefilled:

- decoder stall: the longest wall-clock gap between two tokens of a decoder, max over decoders (ms);
- decoder tokens: tokens the decoders got during the window (mixed: one per chunk forward; plain: only
  between prefills, as the prefill goes first);
- prefill done: seconds from the long prompts' arrival until each has its first token (the last);
- total: seconds for the whole workload, and forwards (batches launched).

The modes alternate for --rounds rounds (this VM is shared and noisy); each round's ratios and the
medians are printed, then one JSON line.

    python benchmark/bench_mixed_chunk.py [--model tiny-qwen3-next-demo] [--decoders 8]
        [--decoder-prompt 64] [--new-tokens 160] [--long 2] [--long-tokens 2048] [--chunk 256]
        [--warm 8] [--rounds 3] [--no-overlap]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from sglang.test.scheduler_harness import SchedulerHarness, token_ids


def run(args: argparse.Namespace, mixed: bool) -> dict:
    total_tokens = (args.decoders * (args.decoder_prompt + args.new_tokens)) + args.long * (args.long_tokens + 8)
    h = SchedulerHarness(
        args.model,
        chunked_prefill_size=args.chunk,
        disable_overlap_schedule=args.no_overlap,
        enable_mixed_chunk=mixed,
        max_total_tokens=total_tokens + 4096,
        max_running_requests=args.decoders + args.long,
        mamba_scheduler_strategy="extra_buffer_lazy",
    )
    sched = h.sched
    forwards = 0
    launch = sched.launch

    def count(batch) -> None:
        nonlocal forwards
        forwards += 1
        launch(batch)

    sched.launch = count
    # Warm-up outside the timing (kernels, allocators): one short request.
    h.generate(token_ids(32, seed=99), max_new_tokens=4, return_logprob=False)
    forwards = 0
    decoders = [
        h.submit(token_ids(args.decoder_prompt, seed=k), args.new_tokens, return_logprob=False, stream=True)
        for k in range(args.decoders)
    ]
    last_token_at: dict[str, float] = {}
    stall = {rid: 0.0 for rid in decoders}
    got = {rid: 0 for rid in decoders}
    window_tokens = 0
    longs: list[str] = []
    finished_longs: list[dict] = []
    t0 = time.perf_counter()
    t_long = prefill_done = None
    steps = 0
    while True:
        if steps == args.warm:
            t_long = time.perf_counter()
            longs = [
                h.submit(token_ids(args.long_tokens, seed=1000 + k), 8, return_logprob=False)
                for k in range(args.long)
            ]
        busy = sched.step()
        steps += 1
        now = time.perf_counter()
        for msg in sched.detokenizer_outbox:
            for i, rid in enumerate(msg.rids):
                if rid in longs and msg.finished_reasons[i] is not None:
                    finished_longs.append(msg.finished_reasons[i])
                if rid in got and msg.output_ids[i]:
                    if rid in last_token_at:
                        stall[rid] = max(stall[rid], now - last_token_at[rid]) if t_long else stall[rid]
                    last_token_at[rid] = now
                    got[rid] += len(msg.output_ids[i])
                    if t_long is not None and prefill_done is None:
                        window_tokens += len(msg.output_ids[i])
        sched.detokenizer_outbox.clear()
        if t_long is not None and prefill_done is None:
            if all((r := sched.reqs_by_rid.get(rid)) is None or r.output_ids for rid in longs):
                prefill_done = now - t_long
        if not busy and steps > args.warm:
            break
    total = time.perf_counter() - t0
    assert all(n == args.new_tokens for n in got.values()), got
    # (a prompt over the model's context would be refused at once and time nothing)
    assert [f["type"] for f in finished_longs] == ["length"] * args.long, finished_longs
    h.shutdown()
    return {
        "stall_ms": 1000 * max(stall.values()),
        "window_decoder_tokens": window_tokens,
        "prefill_done_s": prefill_done,
        "total_s": total,
        "forwards": forwards,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny-qwen3-next-demo")
    p.add_argument("--decoders", type=int, default=8)
    p.add_argument("--decoder-prompt", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--long", type=int, default=2)
    p.add_argument("--long-tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--warm", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-overlap", action="store_true")
    args = p.parse_args()
    rows = {False: [], True: []}
    for r in range(args.rounds):
        for mixed in (r % 2 == 1, r % 2 == 0):  # alternate which goes first
            rows[mixed].append(run(args, mixed))
        plain, mix = rows[False][-1], rows[True][-1]
        print(
            f"round {r}: stall {plain['stall_ms']:.0f} -> {mix['stall_ms']:.0f} ms, window tokens "
            f"{plain['window_decoder_tokens']} -> {mix['window_decoder_tokens']}, prefill done "
            f"{plain['prefill_done_s']:.2f} -> {mix['prefill_done_s']:.2f} s, total {plain['total_s']:.2f} -> "
            f"{mix['total_s']:.2f} s, forwards {plain['forwards']} -> {mix['forwards']}",
            flush=True,
        )
    med = {m: {k: statistics.median(row[k] for row in rows[m]) for k in rows[m][0]} for m in rows}
    ratios = {k: med[True][k] / med[False][k] for k in med[True] if med[False][k]}
    print(json.dumps({"args": vars(args), "plain": med[False], "mixed": med[True], "mixed_over_plain": ratios}))


if __name__ == "__main__":
    main()
