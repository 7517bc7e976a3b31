"""Upstream's token histograms and collection warning: `--prompt-tokens-buckets` and
`--generation-tokens-buckets` rules (default, tse, custom; a bad one refused at start naming the flag),
`sglang:prompt_tokens_histogram`, `sglang:uncached_prompt_tokens_histogram` and
`sglang:generation_tokens_histogram` observed at each finish, and `--gc-warning-threshold-secs`' warning."""

from __future__ import annotations

import gc
import logging
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sglang.srt.metrics.collector import MetricsCollector
from sglang.srt.metrics.token_buckets import DEFAULT_TOKEN_BUCKETS, token_buckets
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.srt.utils.gc_watch import unwatch_gc, watch_gc
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")


def test_the_bucket_rules_give_upstreams_bounds():
    assert token_buckets(None, "--f") == token_buckets(["default"], "--f") == tuple(map(float, DEFAULT_TOKEN_BUCKETS))
    # (upstream's documented example)
    assert token_buckets(["tse", "1000", "2", "8"], "--f") == (984, 992, 996, 998, 1000, 1002, 1004, 1008, 1016)
    assert token_buckets(["custom", "10", "50", "100", "500"], "--f") == (10, 50, 100, 500)
    # Upstream's rules: ceil(COUNT / 2) each side, no bound below 0; custom bounds sorted, each once.
    assert token_buckets(["tse", "1000", "2", "5"], "--f") == (992, 996, 998, 1000, 1002, 1004, 1008)
    assert token_buckets(["tse", "10", "4", "4"], "--f") == (0, 6, 10, 14, 26)
    assert token_buckets(["custom", "50", "10", "50"], "--f") == (10, 50)


@pytest.mark.parametrize(
    "rule",
    [["custom"], ["custom", "inf"], ["custom", "nan"], ["tse", "1000", "1", "8"], ["tse", "1000", "2", "5000"],
     ["tse", "1e300", "1e300", "4"], ["linear", "1"], ["custom", "ten"]],
)  # fmt: skip
def test_a_bad_rule_is_refused_at_start_naming_the_flag(rule):
    with pytest.raises(ServerArgsError, match="^--generation-tokens-buckets"):
        ServerArgs(generation_tokens_buckets=rule)


def test_each_finish_is_observed_in_the_three_histograms():
    m = MetricsCollector("m", prompt_token_buckets=(10, 100), generation_token_buckets=(5, 50))
    for prompt, cached, output in ((40, 30, 7), (150, 0, 3)):
        m.on_finish(SimpleNamespace(finished_reason={"type": "stop"}, prompt_tokens=prompt, cached_tokens=cached,
                                    completion_tokens=output, finish_time=2.0, created_time=1.0, log_metrics=True))  # fmt: skip
    m.on_finish(SimpleNamespace(log_metrics=False))  # (a request that asked not to be counted: ignored)
    families = {f.name: f for f in text_string_to_metric_families(m.render(None).decode())}

    def buckets(name: str) -> dict[str, float]:
        return {s.labels["le"]: s.value for s in families[name].samples if s.name.endswith("_bucket")}

    assert buckets("sglang:prompt_tokens_histogram") == {"10.0": 0, "100.0": 1, "+Inf": 2}
    assert buckets("sglang:uncached_prompt_tokens_histogram") == {"10.0": 1, "100.0": 1, "+Inf": 2}
    assert buckets("sglang:generation_tokens_histogram") == {"5.0": 1, "50.0": 2, "+Inf": 2}


def test_a_long_collection_is_logged(caplog):
    watch_gc(1e-9)  # (every collection is longer)
    try:
        with caplog.at_level(logging.WARNING, logger="sglang.srt.utils.gc_watch"):
            gc.collect()
    finally:
        unwatch_gc()
    (message,) = {r.getMessage() for r in caplog.records}
    assert "took" in message and "--gc-warning-threshold-secs" in message and "/freeze_gc" in message
    with pytest.raises(ServerArgsError, match="--gc-warning-threshold-secs"):
        ServerArgs(gc_warning_threshold_secs=-1)
