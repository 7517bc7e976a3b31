"""Where the scheduler process's time goes, summed since start: what `get_internal_state` reports as
`loop_times`, and what a benchmark reads before and after a workload to split its wall time.

Parts of the scheduler thread's loop (seconds):
- `idle`: waiting for messages (`recv_requests`: up to `IDLE_POLL_MS` per call when nothing runs, a
  non-blocking read otherwise): while requests are on their way from the tokenizer, or the loop has
  nothing to do;
- `intake`: taking the messages in (`process_input_requests`);
- `build`: scheduling and building the next batch (`get_next_batch_to_run`);
- `launch`: handing it to the forward stream (the whole forward where it runs inline, the CPU default);
- `wait`: waiting for a batch's results (the forward thread, then the device's result copy);
- `process`: committing them (`process_batch_result`).
What the loop runs outside these parts (the PD queues' poll, the request deadlines, the heartbeat, the
idle check) is not timed. And the forward stream's own host time, `forward`
(`ForwardWorker.busy_seconds`): per batch, from its start to the results handed back; on a GPU the
launches and the copy's start, not the kernels. Batches are counted by kind. Each part costs two clock
reads per step.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

PARTS = ("idle", "intake", "build", "launch", "wait", "process")


@dataclass
class LoopTimes:
    idle: float = 0.0
    intake: float = 0.0
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
