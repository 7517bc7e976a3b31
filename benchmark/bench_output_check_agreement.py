"""What the TP ranks' agreement on the output checks costs per step: a batch of `n` constrained requests
(stand-in grammars that cost nothing, so what is timed is the agreement and the check's own logic) on two
gloo ranks, each step's checks measured together and agreed once (`FinishChecker.precheck`, now), against
each check measured and agreed alone (one all-reduce per request and token, as before).

    .venv/bin/python benchmark/bench_output_check_agreement.py [--sizes 1,16,64] [--steps 50]

Prints, per batch size, rank 0's milliseconds per step both ways and their ratio (one run: the two
columns are measured minutes apart at most, on the same machine load).
"""

from __future__ import annotations

import argparse

from sglang.test.multi_rank import run_ranks
from sglang.test.output_check_workers import agreement_cost


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,16,64", help="constrained requests per step")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    r0, _ = run_ranks(agreement_cost, 2, sizes, args.steps, timeout=600)
    print(f"{'requests':>8}  {'alone ms/step':>13}  {'batched ms/step':>15}  {'ratio':>6}")
    for n in sizes:
        alone, batched = r0["alone"][n] * 1e3, r0["batched"][n] * 1e3
        print(f"{n:>8}  {alone:>13.3f}  {batched:>15.3f}  {alone / batched:>6.1f}")


if __name__ == "__main__":
    main()
