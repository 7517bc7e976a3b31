"""Prometheus metrics of the server (`--enable-metrics`, served at /metrics), with SGLang's names.

Three sources: the TokenizerManager reports each request's first token and finish (counters and latency
histograms, `on_first_token` / `on_finish`); the HTTP request guard reports the status of every
response (`on_http_response`; 499 for a client that went away before its answer, as nginx counts it);
and the scheduler's internal state, fetched when /metrics is scraped, gives the live gauges (requests,
token pool, mamba slots, lazy allocation failures, speculative decoding's accept length).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class SchedulerStateCollector(Collector):
    """Gauges from the latest scheduler snapshot (nothing before the first scrape)."""

    def __init__(self, model_name: str):
        self.model_name = model_name
        self.state: dict[str, Any] | None = None

    def collect(self) -> Iterator[Metric]:
        s = self.state
        if s is None:
            return
        labels = ["model_name"]
        yield _gauge("sglang:num_running_reqs", "Requests running.", s["num_running_reqs"], self.model_name)
        yield _gauge("sglang:num_queue_reqs", "Requests waiting.", s["num_waiting_reqs"], self.model_name)
        tok = s["token_usage"]
        used = tok["total"] - tok["free"]
        yield _gauge(
            "sglang:token_usage",
            "Fraction of KV token slots in use.",
            used / max(tok["total"], 1),
            self.model_name,
        )
        mamba = s["mamba_usage"]
        used = mamba["total"] - mamba["free"]
        yield _gauge(
            "sglang:mamba_usage",
            "Fraction of mamba state slots in use.",
            used / max(mamba["total"], 1),
            self.model_name,
        )
        for pool, usage in (("token", tok), ("mamba", mamba)):
            g = GaugeMetricFamily(
                f"sglang:{pool}_slots", f"{pool} pool slots by owner.", labels=[*labels, "owner"]
            )
            for owner in ("free", "held_by_requests", "held_by_tree"):
                g.add_metric([self.model_name, owner], usage[owner])
            yield g
        g = CounterMetricFamily(
            "sglang:mamba_lazy_alloc_failures",
            "extra_buffer_lazy track-slot allocations that failed, by attempt.",
            labels=[*labels, "attempt"],
        )
        for attempt, value in s["lazy_alloc_failures"].items():
            g.add_metric([self.model_name, attempt], value)
        yield g
        if "avg_spec_accept_length" in s:  # --speculative-algorithm
            yield _gauge(
                "sglang:spec_accept_length",
                "Tokens committed per request and speculative verify, since start.",
                s["avg_spec_accept_length"],
                self.model_name,
            )


class MetricsCollector:
    def __init__(self, model_name: str):
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        self.num_requests = counter("sglang:num_requests", "Requests finished.")
        self.num_aborted = counter(
            "sglang:num_aborted_requests",
            "Requests aborted (by /abort_request or by a client that went away).",
        )
        self.prompt_tokens = counter("sglang:prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("sglang:generation_tokens", "Generated tokens.")
        self.cached_tokens = counter("sglang:cached_tokens", "Prompt tokens served from the prefix cache.")
        self.http_responses = Counter(
            "sglang:http_responses",
            "HTTP responses by status code (499: the client went away first).",
            [*labels, "status_code"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "Request latency.",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._prompt = 0
        self._cached = 0
        self.scheduler = SchedulerStateCollector(model_name)
        self.registry.register(self.scheduler)
        self.registry.register(_HitRate(self))

    def on_first_token(self, state: Any) -> None:
        self.ttft.observe(state.first_token_time - state.created_time)

    def on_http_response(self, status_code: int) -> None:
        self.http_responses.labels(self.model_name, str(status_code)).inc()

    def on_abort(self, state: Any) -> None:
        self.num_aborted.inc()

    def on_finish(self, state: Any) -> None:
        self.num_requests.inc()
        if state.finished_reason.get("type") == "abort":
            self.num_aborted.inc()
        self.prompt_tokens.inc(state.prompt_tokens)
        self.generation_tokens.inc(state.completion_tokens)
        self.cached_tokens.inc(state.cached_tokens)
        self._prompt += state.prompt_tokens
        self._cached += state.cached_tokens
        self.e2e.observe(state.finish_time - state.created_time)

    def render(self, scheduler_state: dict[str, Any] | None) -> bytes:
        if scheduler_state is not None:
            self.scheduler.state = scheduler_state
        return generate_latest(self.registry)


class _HitRate(Collector):
    def __init__(self, owner: MetricsCollector):
        self.owner = owner

    def collect(self) -> Iterator[Metric]:
        rate = self.owner._cached / self.owner._prompt if self.owner._prompt else 0.0
        yield _gauge(
            "sglang:cache_hit_rate",
            "Prompt tokens served from the cache / prompt tokens.",
            rate,
            self.owner.model_name,
        )


def _gauge(name: str, doc: str, value: float, model_name: str) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc, labels=["model_name"])
    g.add_metric([model_name], value)
    return g
