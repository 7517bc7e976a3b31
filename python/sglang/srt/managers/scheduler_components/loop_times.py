"""Where the scheduler process's time goes, summed since start: what `get_internal_state` reports as
`loop_times`, and what a benchmark reads before and after a workload to split its wall time.

Parts of the scheduler thread's loop (seconds):
- `inputs`: taking requests in (`recv_requests`, which blocks up to `IDLE_POLL_MS` when idle, and
  `process_input_requests`): mostly idle waiting when nothing runs;
- `build`: scheduling and building the next batch (`get_next_batch_to_run`);
- `launch`: handing it to the forward stream (the whole forward where it runs inline, the CPU default);
- `wait`: waiting for a batch's results (the forward thread, then the device's result copy);
- `process`: committing them (`process_batch_result`).
And the forward stream's own host time, `forward` (`ForwardWorker.busy_seconds`): per batch, from its
start to the results handed back; on a GPU the launches and the copy's start, not the kernels.
Batches are counted by kind. Each part costs two clock reads per step.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

PARTS = ("inputs", "build", "launch", "wait", "process")


@dataclass
class LoopTimes:
    inputs: float = 0.0
    build: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    process: float = 0.0
    prefill_batches: int = 0
    decode_batches: int = 0

    def report(self, forward_seconds: float) -> dict[str, float | int]:
        """The sums, rounded to microseconds, with the forward stream's host time."""
        out = {k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(self).items()}
        out["forward"] = round(forward_seconds, 6)
        return out


clock = time.perf_counter
