"""What the TP ranks' agreement on the output checks costs per step: a batch of `n` constrained requests
(stand-in grammars that cost nothing, so what is timed is the agreement and the check's own logic) on two
gloo ranks, each step's checks measured together and agreed once (`FinishChecker.precheck`, now), against
each check measured and agreed alone (one all-reduce per request and token, as before).

With --verify W: a speculative verify step instead, `n` stop_regex requests (a pattern that never
matches) each committing W tokens: every token prechecked in one agreement (`precheck(..., several=True)`,
now) against only each request's first token prechecked and each later token's check agreed alone (as
before).

    .venv/bin/python benchmark/bench_output_check_agreement.py [--sizes 1,16,64] [--steps 50] [--verify 3]

Prints, per batch size, rank 0's milliseconds per step both ways and their ratio (one run: the two
columns are measured minutes apart at most, on the same machine load); with --verify also the
all-reduces per step.
"""

from __future__ import annotations

import argparse

from sglang.test.multi_rank import run_ranks
from sglang.test.output_check_workers import agreement_cost, verify_agreement_cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64", help="constrained requests per step")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--verify", type=int, default=0, help="tokens each request commits per verify step")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.verify:
        r0, _ = run_ranks(verify_agreement_cost, 2, sizes, args.verify, args.steps, timeout=600)
        print(f"verify steps, {args.verify} tokens per request")
        head = ("requests", 8), ("first-only ms", 13), ("all-reduces", 11), ("all ms", 7), ("all-reduces", 11)
        print("  ".join(f"{name:>{width}}" for name, width in head) + f"  {'ratio':>6}")
        for n in sizes:
            (before, before_n), (after, after_n) = r0["first"][n], r0["all"][n]
            print(
                f"{n:>8}  {before * 1e3:>13.3f}  {before_n:>11.1f}  {after * 1e3:>7.3f}  {after_n:>11.1f}"
                f"  {before / after:>6.1f}"
            )
        return
    r0, _ = run_ranks(agreement_cost, 2, sizes, args.steps, timeout=600)
    print(f"{'requests':>8}  {'alone ms/step':>13}  {'batched ms/step':>15}  {'ratio':>6}")
    for n in sizes:
        alone, batched = r0["alone"][n] * 1e3, r0["batched"][n] * 1e3
        print(f"{n:>8}  {alone:>13.3f}  {batched:>15.3f}  {alone / batched:>6.1f}")


if __name__ == "__main__":
    main()
