"""The scheduler's metrics, read from its `get_internal_state` dict when /metrics is scraped.

Upstream's families where this server has the number (names, types, label names and units as
upstream exports them), beside this server's own (`token_usage`, `mamba_usage`, the slots by owner,
`mamba_lazy_alloc_failures`). The scheduler keeps plain numbers (`BatchStatsLog.metrics_state`,
`LoopTimes`, its counters, the model runner's startup times and pool bytes); nothing here runs on its
thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

GB = 2**30  # upstream's "_gb" gauges are GiB (its free-memory readings divided by 1 << 30)
# The scheduler's start phases: (key in its startup_times, the words of the log's `Scheduler start:` line,
# upstream's phase label of sglang:startup_time_seconds or None where upstream's metric has no such phase)
STARTUP_PHASES = (
    ("load_weight", "weights loaded", "load_weight"),
    ("kv_cache_allocation", "pools allocated", "kv_cache_allocation"),
    ("cuda_graph", "CUDA graphs captured", None),
    ("scheduler_e2e", "in all", "scheduler_e2e"),
)


class SchedulerStateCollector(Collector):
    """Families from the latest scheduler snapshot (nothing before the first scrape that got one)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.state: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.state
        if s is None:
            return
        yield from self._requests_and_pools(s)
        yield from self._throughput(s)
        yield from self._startup_and_memory(s)

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        return gauge(name, doc, value, self.model_name)

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=["model_name"])
        c.add_metric([self.model_name], value)
        return c

    def _requests_and_pools(self, s: dict[str, Any]) -> Iterator[Metric]:
        yield self._gauge("sglang:num_running_reqs", "The number of running requests.", s["num_running_reqs"])
        yield self._gauge(
            "sglang:num_queue_reqs", "The number of requests in the waiting queue.", s["num_waiting_reqs"]
        )
        yield self._gauge(
            "sglang:num_grammar_queue_reqs",
            "The number of requests whose grammar is being compiled.",
            s["num_grammar_queue_reqs"],
        )
        tok, mamba = s["token_usage"], s["mamba_usage"]
        if "num_used_tokens" in s:
            yield self._gauge(
                "sglang:num_used_tokens",
                "KV token slots held by requests (the radix tree's evictable entries not counted).",
                s["num_used_tokens"],
            )
        yield self._gauge(
            "sglang:max_total_num_tokens",
            "Maximum total number of tokens in the KV cache pool.",
            tok["total"],
        )
        yield self._gauge(
            "sglang:token_usage",
            "Fraction of KV token slots in use (the radix tree's included).",
            (tok["total"] - tok["free"]) / max(tok["total"], 1),
        )
        yield self._gauge(
            "sglang:mamba_usage",
            "Fraction of mamba state slots in use.",
            (mamba["total"] - mamba["free"]) / max(mamba["total"], 1),
        )
        for pool, usage in (("token", tok), ("mamba", mamba)):
            g = GaugeMetricFamily(
                f"sglang:{pool}_slots", f"{pool} pool slots by owner.", labels=["model_name", "owner"]
            )
            for owner in ("free", "held_by_requests", "held_by_tree"):
                g.add_metric([self.model_name, owner], usage[owner])
            yield g
        c = CounterMetricFamily(
            "sglang:mamba_lazy_alloc_failures",
            "extra_buffer_lazy track-slot allocations that failed, by attempt.",
            labels=["model_name", "attempt"],
        )
        for attempt, value in s["lazy_alloc_failures"].items():
            c.add_metric([self.model_name, attempt], value)
        yield c
        counters = s.get("counters", {})
        if "num_retractions_total" in counters:
            yield self._counter(
                "sglang:num_retracted_requests_total",
                "Total number of retracted requests.",
                counters["num_retractions_total"],
            )

    def _throughput(self, s: dict[str, Any]) -> Iterator[Metric]:
        if "gen_throughput" in s:
            yield self._gauge(
                "sglang:gen_throughput",
                "The generation throughput (token/s) of the last --decode-log-interval decode batches.",
                s["gen_throughput"],
            )
        if "cache_hit_rate" in s:
            yield self._gauge(
                "sglang:cache_hit_rate",
                "The prefix cache hit rate of the last prefill batch (cached / (cached + computed)).",
                s["cache_hit_rate"],
            )
        if "avg_spec_accept_length" in s:  # --speculative-algorithm
            yield self._gauge(
                "sglang:spec_accept_length",
                "Tokens committed per request and speculative verify, since start.",
                s["avg_spec_accept_length"],
            )
        if "realtime_tokens" in s:
            c = CounterMetricFamily(
                "sglang:realtime_tokens",
                "Total number of tokens processed. mode: prefill_compute, prefill_cache, decode.",
                labels=["model_name", "mode"],
            )
            for mode, value in s["realtime_tokens"].items():
                c.add_metric([self.model_name, mode], value)
            yield c
        if "queue_time" in s:
            yield histogram(
                "sglang:queue_time_seconds",
                "Histogram of queueing time in seconds (arrival at the scheduler to its first prefill).",
                s["queue_time"],
                self.model_name,
            )
        if "loop_times" in s:
            yield self._counter(
                "sglang:scheduler_idle_seconds_total",
                "Seconds the scheduler loop waited for messages with nothing to run.",
                s["loop_times"]["idle"],
            )
        if "process_cpu_seconds" in s:
            yield self._counter(
                "sglang:scheduler_process_cpu_seconds_total",
                "CPU seconds of the scheduler process.",
                s["process_cpu_seconds"],
            )

    def _startup_and_memory(self, s: dict[str, Any]) -> Iterator[Metric]:
        times = s.get("startup_times") or {}
        phases = [(label, times[key]) for key, _, label in STARTUP_PHASES if label and key in times]
        if phases:
            g = GaugeMetricFamily(
                "sglang:startup_time_seconds", "Startup time by phase.", labels=["model_name", "phase"]
            )
            for label, value in phases:
                g.add_metric([self.model_name, label], value)
            yield g
        if "cuda_graph" in times:
            g = GaugeMetricFamily(
                "sglang:startup_cuda_graph_time_seconds",
                "CUDA graph capture time at startup (the decode graphs, verify graphs included).",
                labels=["model_name", "phase"],
            )
            g.add_metric([self.model_name, "decode"], times["cuda_graph"])
            yield g
        memory = s.get("memory_bytes") or {}
        if "weights" in memory:
            yield self._gauge(
                "sglang:weight_memory_usage_gb",
                "Memory of the model's weights (GiB).",
                memory["weights"] / GB,
            )
        if "kv_cache" in memory:
            yield self._gauge(
                "sglang:kv_cache_memory_usage_gb",
                "Memory of the KV cache and mamba state pools (GiB).",
                memory["kv_cache"] / GB,
            )


def gauge(name: str, doc: str, value: float, model_name: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model_name"])
    g.add_metric([model_name], value)
    return g


def histogram(name: str, doc: str, snap: dict[str, Any], model_name: str) -> HistogramMetricFamily:
    """A Prometheus histogram from `PlainHistogram.snapshot()` (per-bucket counts, made cumulative)."""
    h = HistogramMetricFamily(name, doc, labels=["model_name"])
    cumulative, total = [], 0
    for bound, count in zip([*snap["buckets"], float("inf")], snap["counts"], strict=True):
        total += count
        cumulative.append((floatToGoString(bound), total))
    h.add_metric([model_name], cumulative, snap["sum"])
    return h
