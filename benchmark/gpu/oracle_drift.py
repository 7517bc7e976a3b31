"""How far the CUDA float32 path drifts from the transformers oracle, request by request, over the
strategy matrix's workloads (test/unit/scheduler/test_strategy_matrix.py) with no tolerance applied:
the numbers a GPU tolerance is chosen from, and the split between flash-linear-attention's TF32 dots and
the rest of the GPU path.

    python3 benchmark/gpu/oracle_drift.py                    # as served: FLA's float32 dots in IEEE
    TRITON_F32_DEFAULT=tf32 python3 benchmark/gpu/oracle_drift.py                  # FLA as it ships
    SGLANG_GDN_EXTEND_BACKEND=torch_varlen python3 benchmark/gpu/oracle_drift.py   # no FLA at all

Prints one JSON line per checked request (rid, prompt and output lengths, cached tokens, max |dlogprob|)
and a last line with the maximum. Measured on an H200 (2026-11-27, no_buffer, tiny-qwen3-next): TF32
0.235, IEEE 7.7e-6, the torch form 8.8e-6 (`layers/attention/fla_float32.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny-qwen3-next", choices=["tiny-qwen3-next", "tiny-nemotron-h"])
    ap.add_argument("--strategy", default="no_buffer")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    sys.path[:0] = [str(ROOT / "test"), str(ROOT / "test/unit/scheduler")]
    import test_strategy_matrix as matrix

    from conftest import _Oracles
    from sglang.test.scheduler_harness import SchedulerHarness

    check, rows = SchedulerHarness.check_oracle, []

    def record(self, oracle, prompt, out, tol=0.0):
        err = check(self, oracle, prompt, out, float("inf"))
        rows.append(
            dict(rid=out.rid, prompt=len(prompt), output=len(out.output_ids), cached=out.cached_tokens, err=err)
        )
        print(json.dumps(rows[-1]), flush=True)
        return err

    SchedulerHarness.check_oracle = record
    h = matrix._harness(args.preset, args.strategy, False, 1, None, device=args.device, dtype="float32")
    matrix._run_workloads(h, _Oracles()[args.preset], float("inf"))
    env = {k: os.environ.get(k) for k in ("TRITON_F32_DEFAULT", "SGLANG_GDN_EXTEND_BACKEND")}
    print(json.dumps({"max_err": max(r["err"] for r in rows), **env}))


if __name__ == "__main__":
    main()
