"""A histogram kept as plain numbers in the scheduler process, read by `/metrics` at scrape time.

The scheduler has no Prometheus registry: its metrics travel in `get_internal_state`'s dict, so a
histogram there is its bucket counts and sum (`snapshot`), which the HTTP process turns into a
Prometheus histogram family (`metrics/scheduler_collector.py`). An observation is one bisect and two
additions, cheap enough for every request at every admission.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import Any

# Upstream's buckets for sglang:queue_time_seconds (seconds), so that dashboards' quantiles agree.
QUEUE_TIME_BUCKETS = (
    0.0, 0.1, 0.2, 0.5, 1, 2, 3, 4, 5, 10, 15, 20, 30, 40, 50, 60, 70, 80, 90, 100, 200, 300, 400,
    500, 600, 700, 800, 900, 1000, 1200, 1400, 1600, 1800, 2000, 2500, 3000,
)  # fmt: skip


class PlainHistogram:
    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = tuple(float(b) for b in buckets)
        self.counts = [0] * (len(self.buckets) + 1)  # the last one: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # Prometheus buckets are upper bounds, inclusive: a value equal to a bound counts in it.
        self.counts[bisect_left(self.buckets, value)] += 1
        self.sum += value

    def snapshot(self) -> dict[str, Any]:
        """Per-bucket (not cumulative) counts, the last above every bound, and the sum."""
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum}
