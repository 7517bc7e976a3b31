"""/metrics with upstream SGLang's families (issue 60, item 3), below the HTTP server: the scheduler's
numbers (`get_internal_state`, on the scheduler harness), the collector's exposition read back with
prometheus_client's parser (names, types, label names, values), and the request guard's endpoint labels.
The registered server test (test_openai_api.py, `test_metrics_upstream_families`) scrapes a real one."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.responses import Response
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.entrypoints.http_guard import UNMATCHED, RequestGuard
from sglang.srt.metrics.collector import MetricsCollector
from sglang.srt.metrics.histogram import QUEUE_TIME_BUCKETS, PlainHistogram
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness

register_cpu_ci(est_time=12, suite="per-commit-cpu")

MODEL = "tiny-qwen3-next"
PROMPT = list(range(5, 205))  # 200 tokens: four chunks of the 64-token prefill chunk below
MAX_NEW = 10

# Upstream's families this server exports: name as exposed -> (type, label names besides le).
UPSTREAM_FAMILIES = {
    "sglang:num_running_reqs": ("gauge", {"model_name"}),
    "sglang:num_queue_reqs": ("gauge", {"model_name"}),
    "sglang:num_grammar_queue_reqs": ("gauge", {"model_name"}),
    "sglang:num_used_tokens": ("gauge", {"model_name"}),
    "sglang:max_total_num_tokens": ("gauge", {"model_name"}),
    "sglang:token_usage": ("gauge", {"model_name"}),
    "sglang:mamba_usage": ("gauge", {"model_name"}),
    "sglang:gen_throughput": ("gauge", {"model_name"}),
    "sglang:cache_hit_rate": ("gauge", {"model_name"}),
    "sglang:queue_time_seconds": ("histogram", {"model_name"}),
    "sglang:realtime_tokens": ("counter", {"model_name", "mode"}),
    "sglang:scheduler_idle_seconds": ("counter", {"model_name"}),
    "sglang:scheduler_process_cpu_seconds": ("counter", {"model_name"}),
    "sglang:num_retracted_requests": ("counter", {"model_name"}),
    "sglang:startup_time_seconds": ("gauge", {"model_name", "phase"}),
    "sglang:weight_memory_usage_gb": ("gauge", {"model_name"}),
    "sglang:kv_cache_memory_usage_gb": ("gauge", {"model_name"}),
    "sglang:num_requests": ("counter", {"model_name"}),
    "sglang:num_aborted_requests": ("counter", {"model_name"}),
    "sglang:prompt_tokens": ("counter", {"model_name"}),
    "sglang:generation_tokens": ("counter", {"model_name"}),
    "sglang:cached_tokens": ("counter", {"model_name", "cache_source"}),
    "sglang:time_to_first_token_seconds": ("histogram", {"model_name"}),
    "sglang:inter_token_latency_seconds": ("histogram", {"model_name"}),
    "sglang:e2e_request_latency_seconds": ("histogram", {"model_name"}),
    "sglang:http_requests": ("counter", {"endpoint", "method"}),
    "sglang:http_responses": ("counter", {"model_name", "status_code", "endpoint", "method"}),
    "sglang:http_requests_active": ("gauge", {"endpoint", "method"}),
    "sglang:process_cpu_seconds": ("counter", {"component"}),
}


def parse(text: bytes) -> dict[str, Any]:
    """family name (counters without _total, as the parser names them) -> family."""
    return {f.name: f for f in text_string_to_metric_families(text.decode())}


def value(families: dict[str, Any], sample: str, **labels: str) -> float:
    family = families[sample.removesuffix("_total").removesuffix("_count").removesuffix("_sum")]
    found = [s.value for s in family.samples if s.name == sample and labels.items() <= s.labels.items()]
    assert len(found) == 1, (sample, labels, family.samples)
    return found[0]


@pytest.fixture(scope="module")
def scheduler_state() -> dict[str, Any]:
    """Three requests on the harness: one alone, then its prompt again (a cache hit) beside a new one;
    the 200-token prompts prefill in four 64-token chunks."""
    h = SchedulerHarness(decode_log_interval=4, chunked_prefill_size=64)
    try:
        h.generate(PROMPT, MAX_NEW)
        h.submit(PROMPT, MAX_NEW)
        h.submit(list(range(300, 330)), MAX_NEW)
        h.run()
        state = h.sched.get_internal_state()
        runner = h.sched.model_runner
        state["_expected_weight_bytes"] = sum(p.numel() * p.element_size() for p in runner.model.parameters())
        return state
    finally:
        h.shutdown()


def test_scheduler_state_counts_each_request_and_token_once(scheduler_state: dict[str, Any]) -> None:
    s = scheduler_state
    prompt_tokens = 2 * len(PROMPT) + 30
    # Queue time: once per request, not once per chunk (the 200-token prompts ran in four).
    assert sum(s["queue_time"]["counts"]) == 3
    assert s["queue_time"]["sum"] > 0
    tokens = s["realtime_tokens"]
    # Every prompt token is computed or taken from the cache, once; the cache gave the repeated prompt's.
    assert tokens["prefill_compute"] + tokens["prefill_cache"] == prompt_tokens
    assert tokens["prefill_cache"] == s["counters"]["num_cached_tokens_total"] > 0
    # Decode batches make each request's tokens after the first (the prefill samples that one).
    assert tokens["decode"] == 3 * (MAX_NEW - 1)
    assert s["gen_throughput"] > 0  # 9 decode steps: two windows of 4 closed
    # The last prefill batch: the repeated prompt's cached tokens over that batch's prompt tokens.
    last = s["counters"]["num_cached_tokens_total"]  # (all of it came in that batch)
    assert s["cache_hit_rate"] == pytest.approx(last / (len(PROMPT) + 30))
    assert s["num_used_tokens"] == 0  # idle: what the tree keeps is evictable, so not counted
    assert s["startup_times"]["load_weight"] > 0 and s["startup_times"]["kv_cache_allocation"] > 0
    assert s["memory_bytes"]["weights"] == s["_expected_weight_bytes"]
    assert s["memory_bytes"]["kv_cache"] > 0
    assert s["process_cpu_seconds"] > 0


def test_plain_histogram_buckets_are_inclusive_upper_bounds() -> None:
    h = PlainHistogram((0.0, 1.0, 2.0))
    for v in (0.0, 0.5, 1.0, 1.5, 7.0):
        h.observe(v)
    assert h.snapshot() == {"buckets": [0.0, 1.0, 2.0], "counts": [1, 2, 1, 1], "sum": 10.0}
    assert len(PlainHistogram(QUEUE_TIME_BUCKETS).counts) == len(QUEUE_TIME_BUCKETS) + 1


def request_state(created: float, stream: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        created_time=created,
        first_token_time=None,
        last_token_time=None,
        finish_time=None,
        finished_reason={"type": "length"},
        prompt_tokens=7,
        completion_tokens=0,
        cached_tokens=3,
        req=SimpleNamespace(stream=stream),
        log_metrics=True,
    )


def test_exposition_has_upstream_families_types_labels_and_values(scheduler_state: dict[str, Any]) -> None:
    m = MetricsCollector(MODEL)
    t0 = time.time()
    streamed = request_state(t0 - 0.2)
    streamed.first_token_time = t0 - 0.1
    m.on_first_token(streamed)
    m.on_tokens(streamed, 1)
    m.on_tokens(streamed, 3)  # one message with three tokens (a verify's): three latencies
    streamed.completion_tokens, streamed.finish_time = 5, time.time()
    m.on_finish(streamed)
    plain = request_state(t0)  # not streamed: no first token time, so no TTFT or ITL
    m.on_tokens(plain, 4)
    plain.completion_tokens, plain.finish_time = 4, time.time()
    m.on_finish(plain)
    m.on_http_request("/generate", "POST")
    m.on_http_request("/generate", "POST")
    m.on_http_response("/generate", "POST", 200)
    m.on_http_done("/generate", "POST")
    families = parse(m.render(scheduler_state))

    for name, (kind, labels) in UPSTREAM_FAMILIES.items():
        assert name in families, name
        assert families[name].type == kind, name
        for sample in families[name].samples:
            assert set(sample.labels) - {"le"} == labels, (name, sample)
    assert value(families, "sglang:time_to_first_token_seconds_count", model_name=MODEL) == 1
    # Inter-token latency: the tokens after the first message's, 1 + 3.
    assert value(families, "sglang:inter_token_latency_seconds_count", model_name=MODEL) == 4
    itl_sum = value(families, "sglang:inter_token_latency_seconds_sum", model_name=MODEL)
    assert 0.1 <= itl_sum < 10  # from the first token (0.1 s before t0) to the last on_tokens
    assert value(families, "sglang:e2e_request_latency_seconds_count", model_name=MODEL) == 2
    assert value(families, "sglang:num_requests_total", model_name=MODEL) == 2
    assert value(families, "sglang:generation_tokens_total", model_name=MODEL) == 9
    assert value(families, "sglang:prompt_tokens_total", model_name=MODEL) == 14
    assert value(families, "sglang:cached_tokens_total", model_name=MODEL, cache_source="device") == 6
    assert value(families, "sglang:http_requests_total", endpoint="/generate", method="POST") == 2
    assert value(families, "sglang:http_requests_active", endpoint="/generate", method="POST") == 1
    assert value(families, "sglang:http_responses_total", status_code="200", endpoint="/generate") == 1
    assert value(families, "sglang:queue_time_seconds_count", model_name=MODEL) == 3
    assert value(families, "sglang:realtime_tokens_total", mode="decode") == 3 * (MAX_NEW - 1)
    assert value(families, "sglang:startup_time_seconds", phase="load_weight") > 0
    weights_gb = value(families, "sglang:weight_memory_usage_gb", model_name=MODEL)
    assert weights_gb == pytest.approx(scheduler_state["memory_bytes"]["weights"] / 2**30)
    assert value(families, "sglang:process_cpu_seconds_total", component="tokenizer") > 0
    assert value(families, "sglang:process_cpu_seconds_total", component="scheduler") > 0


def test_without_a_scheduler_snapshot_the_request_side_still_renders() -> None:
    families = parse(MetricsCollector(MODEL).render(None))
    assert "sglang:num_requests" in families and "sglang:queue_time_seconds" not in families


def test_histogram_buckets_follow_the_bucket_flags() -> None:
    """--bucket-time-to-first-token, --bucket-inter-token-latency, --bucket-e2e-request-latency (upstream's)."""
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", MODEL, "--enable-metrics", "--bucket-time-to-first-token", "0.3",
                                "1.5", "--bucket-inter-token-latency", "0.02", "--bucket-e2e-request-latency", "2",
                                "20", "200"])  # fmt: skip
    metrics = MetricsCollector(MODEL, args.bucket_time_to_first_token, args.bucket_inter_token_latency,
                               args.bucket_e2e_request_latency)  # fmt: skip
    families = parse(metrics.render(None))

    def bounds(name: str) -> list[float]:
        return [float(s.labels["le"]) for s in families[name].samples if s.name.endswith("_bucket")]

    inf = float("inf")
    assert bounds("sglang:time_to_first_token_seconds") == [0.3, 1.5, inf]
    assert bounds("sglang:inter_token_latency_seconds") == [0.02, inf]
    assert bounds("sglang:e2e_request_latency_seconds") == [2.0, 20.0, 200.0, inf]
    default = parse(MetricsCollector(MODEL).render(None))
    assert len([s for s in default["sglang:time_to_first_token_seconds"].samples if s.name.endswith("_bucket")]) > 3


def test_request_guard_labels_routes_by_template_and_tracks_active_requests() -> None:
    metrics = MetricsCollector(MODEL)
    app = FastAPI()
    seen_active: list[float] = []

    @app.get("/items/{item_id}")
    async def item(item_id: str) -> Response:
        families = parse(metrics.render(None))
        seen_active.append(value(families, "sglang:http_requests_active", endpoint="/items/{item_id}"))
        return Response(item_id)

    guard = RequestGuard(app, max_body_bytes=1000, read_timeout=1.0, observer=metrics)

    async def call(method: str, path: str) -> int:
        scope = {
            "type": "http", "method": method, "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": b"", "headers": [], "http_version": "1.1", "scheme": "http",
            "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1), "app": app,
        }  # fmt: skip
        statuses: list[int] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.append(message["status"])

        await guard(scope, receive, send)
        return statuses[0]

    assert asyncio.run(call("GET", "/items/a")) == 200
    assert asyncio.run(call("GET", "/items/b")) == 200
    assert asyncio.run(call("POST", "/items/c")) == 405  # the route's, for another method
    for i in range(3):
        assert asyncio.run(call("GET", f"/no/such/path/{i}")) == 404
    assert seen_active == [1, 1]  # while each ran, it was the one active request
    families = parse(metrics.render(None))
    assert value(families, "sglang:http_requests_total", endpoint="/items/{item_id}", method="GET") == 2
    assert value(families, "sglang:http_requests_active", endpoint="/items/{item_id}", method="GET") == 0
    assert value(families, "sglang:http_responses_total", endpoint="/items/{item_id}", status_code="405") == 1
    # Paths no route serves share one label value: a client cannot add series by inventing paths.
    assert value(families, "sglang:http_responses_total", endpoint=UNMATCHED, status_code="404") == 3
    endpoints = {s.labels["endpoint"] for s in families["sglang:http_requests"].samples}
    assert endpoints == {"/items/{item_id}", UNMATCHED}
