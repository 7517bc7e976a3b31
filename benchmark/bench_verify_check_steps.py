"""The scheduler's seconds in output checks per step, with costly stop_regex requests under speculative
verifies: `--clients` greedy requests of `--tokens` tokens (ignore_eos) whose stop_regex backtracks on
every check (the security review's pattern, 2026-11-29 row 4; each prompt generated once before without
it, so NGRAM's drafts of its output are accepted) beside a bystander, on an in-process scheduler
(`SchedulerHarness`, tiny-qwen3-next, the default budgets: 50 ms a request, 200 ms a step). Prints, until
the bystander ends: its seconds, the steps, the heaviest step's checks, the steps whose checks took more
than the step's budget, the requests ended with a 400, and the checks measured and agreed alone.

    .venv/bin/python benchmark/bench_verify_check_steps.py            # NGRAM, 4 draft tokens
    .venv/bin/python benchmark/bench_verify_check_steps.py --plain    # plain decoding

The step's time is what every running request waits for besides the forward (`check_finished` and
`precheck` timed); the bystander's seconds sway with the host's load, the per-step checks much less.
"""

from __future__ import annotations

import argparse
import json
import time

from sglang.test.scheduler_harness import SchedulerHarness, token_ids

PATTERN = r"(?:[\s\S]{1,60}){1,2}(?!)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=150)
    parser.add_argument("--pattern", default=PATTERN)
    parser.add_argument("--plain", action="store_true", help="plain decoding (no speculative verifies)")
    parser.add_argument("--draft-tokens", type=int, default=4)
    args = parser.parse_args()
    spec = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=args.draft_tokens)
    if args.plain:
        spec = {}
    h = SchedulerHarness("tiny-qwen3-next", disable_overlap_schedule=True, **spec)
    for k in range(args.clients):  # (NGRAM's cache learns each output: the requests below draft it)
        h.generate(token_ids(8, seed=k), max_new_tokens=args.tokens, ignore_eos=True)
    finisher, spent = h.sched.finisher, [0.0]
    check, precheck = finisher.check_finished, finisher.precheck

    def timed(call):
        def run(*a, **kw):
            start = time.perf_counter()
            try:
                return call(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - start

        return run

    finisher.check_finished, finisher.precheck = timed(check), timed(precheck)
    alone = finisher.alone
    clients = [
        h.submit(token_ids(8, seed=k), max_new_tokens=args.tokens, stop_regex=[args.pattern], ignore_eos=True)
        for k in range(args.clients)
    ]
    bystander = h.submit(token_ids(8, seed=99), max_new_tokens=args.tokens)
    steps, start = [], time.perf_counter()
    while h.outputs[bystander].finished_reason is None:
        spent[0] = 0.0
        h.sched.step()
        h.collect()
        steps.append(spent[0])
    seconds = time.perf_counter() - start
    h.run()
    reasons = [h.outputs[r].finished_reason for r in clients]
    budget = finisher.budget.per_step_s
    print(
        json.dumps(
            {
                "speculative": not args.plain,
                "bystander_s": round(seconds, 2),
                "steps": len(steps),
                "max_step_checks_s": round(max(steps), 3),
                "steps_over_budget": sum(s > budget for s in steps),
                "ended_400": sum(r["type"] == "abort" for r in reasons),
                "checks_alone": finisher.alone - alone,
                "first_400": next((r["message"][:100] for r in reasons if r["type"] == "abort"), None),
                "spec_stats": h.sched.spec.stats if not args.plain else None,
            }
        )
    )
    h.shutdown()


if __name__ == "__main__":
    main()
