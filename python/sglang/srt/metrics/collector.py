"""Prometheus metrics of the server (`--enable-metrics`, served at /metrics), with upstream SGLang's names,
types, label names and units (docs/server.md, "Metrics", lists them and the ones left out).

Three sources:
- the TokenizerManager reports each request's first tokens, later tokens and finish (`on_first_token`,
  `on_tokens`, `on_finish`, `on_abort`): the request counters and the latency histograms. Only a
  streamed request hears of its tokens as they come, so time to first token and inter-token latency
  are observed for streamed requests (a request that is not streamed gets one message at its end);
- the HTTP request guard (`HttpObserver`) reports each request's route and method as it starts and
  ends and its status (499 for a client that went away before its answer, as nginx counts it);
- the scheduler's internal state, fetched when /metrics is scraped, gives its gauges, counters and
  the queue-time histogram (`scheduler_collector.py`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from sglang.srt.metrics.scheduler_collector import SchedulerStateCollector
from sglang.srt.metrics.token_buckets import DEFAULT_TOKEN_BUCKETS

# This server's buckets for time to first token and request latency (since before upstream's names
# were adopted): they start at 10 ms, where upstream's start at 0.1 s, below which small models' times
# on one machine fall.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
# Upstream's inter-token latency buckets (seconds).
ITL_BUCKETS = (
    0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080, 0.100,
    0.200, 0.400, 0.600, 0.800, 1.000, 2.000, 4.000, 6.000, 8.000,
)  # fmt: skip
# The prefix cache here is the one on the model's device (upstream also has host and storage tiers).
CACHE_SOURCE = "device"


class MetricsCollector:
    def __init__(
        self,
        model_name: str,
        ttft_buckets: Sequence[float] | None = None,
        itl_buckets: Sequence[float] | None = None,
        e2e_buckets: Sequence[float] | None = None,
        prompt_token_buckets: Sequence[float] = DEFAULT_TOKEN_BUCKETS,
        generation_token_buckets: Sequence[float] = DEFAULT_TOKEN_BUCKETS,
    ):
        """The buckets: --bucket-time-to-first-token, --bucket-inter-token-latency and
        --bucket-e2e-request-latency (None: this module's defaults); --prompt-tokens-buckets and
        --generation-tokens-buckets' (`token_buckets.py`)."""
        disable_created_metrics()
        self.model_name = model_name
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labels, registry=self.registry).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, labels, buckets=buckets, registry=self.registry).labels(model_name)

        self.num_requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.num_aborted = counter(
            "sglang:num_aborted_requests_total",
            "Requests aborted (by /abort_request or by a client that went away).",
        )
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed."
        )
        self.cached_tokens = Counter(
            "sglang:cached_tokens_total",
            "Number of cached prompt tokens by source (device: the radix cache of the model's device).",
            [*labels, "cache_source"],
            registry=self.registry,
        ).labels(model_name, CACHE_SOURCE)
        self.http_requests = Counter(
            "sglang:http_requests_total",
            "Total number of HTTP requests by endpoint and method.",
            ["endpoint", "method"],
            registry=self.registry,
        )
        self.http_responses = Counter(
            "sglang:http_responses_total",
            "HTTP responses by endpoint, method and status code (499: the client went away first).",
            [*labels, "status_code", "endpoint", "method"],
            registry=self.registry,
        )
        self.http_active = Gauge(
            "sglang:http_requests_active",
            "Number of currently active HTTP requests.",
            ["endpoint", "method"],
            registry=self.registry,
        )
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds",
            "Histogram of time to first token in seconds (streamed requests).",
            tuple(ttft_buckets or LATENCY_BUCKETS),
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds (streamed requests).",
            tuple(itl_buckets or ITL_BUCKETS),
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of end-to-end request latency in seconds.",
            tuple(e2e_buckets or LATENCY_BUCKETS),
        )
        # Upstream's token histograms (a request's prompt, the part of it the cache did not hold, its output).
        self.prompt_tokens_histogram = histogram(
            "sglang:prompt_tokens_histogram", "Histogram of prompt token length.", tuple(prompt_token_buckets)
        )
        self.uncached_prompt_tokens_histogram = histogram(
            "sglang:uncached_prompt_tokens_histogram",
            "Histogram of uncached (compute) prompt token length.",
            tuple(prompt_token_buckets),
        )
        self.generation_tokens_histogram = histogram(
            "sglang:generation_tokens_histogram", "Histogram of generation token length.", tuple(generation_token_buckets)
        )
        self.scheduler = SchedulerStateCollector(model_name)
        self.registry.register(self.scheduler)
        self.registry.register(_ProcessCpu(self.scheduler))

    # ---- requests (TokenizerManager) ---------------------------------------------------------------

    # (A request that asked `log_metrics: false`, and the server's own, are not counted: upstream's.)

    def on_first_token(self, state: Any) -> None:
        if not state.log_metrics:
            return
        self.ttft.observe(state.first_token_time - state.created_time)
        state.last_token_time = state.first_token_time

    def on_tokens(self, state: Any, num_new_tokens: int) -> None:
        """`num_new_tokens` arrived after the first: each counts once in the inter-token latency, at the
        interval since the previous arrival shared among them (upstream's observation)."""
        if state.last_token_time is None or num_new_tokens <= 0 or not state.log_metrics:
            return  # not streamed: no arrival times
        now = time.time()
        interval = now - state.last_token_time
        state.last_token_time = now
        for _ in range(num_new_tokens):  # one per token the message carries
            self.itl.observe(interval / num_new_tokens)

    def on_abort(self, state: Any) -> None:
        if state.log_metrics:
            self.num_aborted.inc()

    def on_finish(self, state: Any) -> None:
        if not state.log_metrics:
            return
        self.num_requests.inc()
        if state.finished_reason.get("type") == "abort":
            self.num_aborted.inc()
        self.prompt_tokens.inc(state.prompt_tokens)
        self.generation_tokens.inc(state.completion_tokens)
        self.cached_tokens.inc(state.cached_tokens)
        self.e2e.observe(state.finish_time - state.created_time)
        self.prompt_tokens_histogram.observe(state.prompt_tokens)
        self.uncached_prompt_tokens_histogram.observe(state.prompt_tokens - state.cached_tokens)
        self.generation_tokens_histogram.observe(state.completion_tokens)

    # ---- HTTP (RequestGuard's HttpObserver) --------------------------------------------------------

    def on_http_request(self, endpoint: str, method: str) -> None:
        self.http_requests.labels(endpoint, method).inc()
        self.http_active.labels(endpoint, method).inc()

    def on_http_response(self, endpoint: str, method: str, status_code: int) -> None:
        self.http_responses.labels(self.model_name, str(status_code), endpoint, method).inc()

    def on_http_done(self, endpoint: str, method: str) -> None:
        self.http_active.labels(endpoint, method).dec()

    def render(self, scheduler_state: dict[str, Any] | None) -> bytes:
        if scheduler_state is not None:
            self.scheduler.state = scheduler_state
        return generate_latest(self.registry)


class _ProcessCpu(Collector):
    """Upstream's sglang:process_cpu_seconds_total by component: this process (the tokenizer manager's
    and the HTTP server's) and, from its latest snapshot, the scheduler's."""

    def __init__(self, scheduler: SchedulerStateCollector):
        self.scheduler = scheduler

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily(
            "sglang:process_cpu_seconds", "CPU seconds of the server's processes.", labels=["component"]
        )
        c.add_metric(["tokenizer"], time.process_time())
        state = self.scheduler.state
        if state is not None and "process_cpu_seconds" in state:
            c.add_metric(["scheduler"], state["process_cpu_seconds"])
        yield c
