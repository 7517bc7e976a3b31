"""The server's warm-up request (upstream's; --skip-server-warmup skips it): one short generation runs
through the whole path before the port listens and "ready to roll" is logged, counts in no metric, and
leaves nothing cached; a warm-up that fails stops the server with status 1 and one sentence."""

from __future__ import annotations

import re

import pytest
import requests

from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.entrypoints.server_warmup import WARMUP_NEW_TOKENS, WARMUP_TEXT
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerProcess

register_cpu_ci(est_time=20, suite="per-commit-cpu")

MODEL = "tiny-qwen3-next"


def _metric(text: str, name: str) -> float:
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name)]
    assert values, f"{name} is not in /metrics"
    return sum(values)


@pytest.fixture(scope="module")
def launched():
    """The three tests' servers, started together when the first test starts (the later ones load while
    the earlier tests run); each test takes its own and stops it."""
    procs = {
        "metrics": ServerProcess(["--model-path", MODEL, "--enable-metrics"]),
        "skip": ServerProcess(["--model-path", MODEL, "--skip-server-warmup"]),
        # The warm-up's forward outlasts --watchdog-timeout.
        "stall": ServerProcess(
            ["--model-path", MODEL, "--watchdog-timeout", "1"], env={"SGLANG_TEST_FORWARD_DELAY_MS": "4000"}
        ),
    }
    try:
        yield procs
    finally:
        for server in procs.values():
            server.stop()  # (again, for one its test stopped)


def test_the_warmup_runs_before_ready_counts_nowhere_and_leaves_nothing_cached(launched):
    server = launched["metrics"]
    try:
        server.wait_ready()
        log = server.log_text()
        done = re.search(r"Warm-up request done in [\d.]+ s: (\d+) prompt tokens, (\d+) generated", log)
        assert done, log
        assert int(done.group(2)) == WARMUP_NEW_TOKENS
        assert log.index("Warm-up request done") < log.index("ready to roll")
        metrics = requests.get(server.base_url + "/metrics", timeout=10).text
        assert _metric(metrics, "sglang:prompt_tokens_total") == 0
        # The scheduler's counts too (before the fix they held the warm-up's prompt and decoded tokens and its
        # queue time).
        assert _metric(metrics, "sglang:realtime_tokens_total") == 0
        assert _metric(metrics, "sglang:queue_time_seconds_count") == 0
        # Nothing cached: without the flush the tree holds the warm-up's KV and its final state.
        state = requests.get(server.base_url + "/get_server_info", timeout=10).json()["internal_states"][0]
        assert state["token_usage"]["held_by_tree"] == 0 and state["mamba_usage"]["held_by_tree"] == 0, state
        # The prompt it logged is the warm-up text's.
        ids = get_tokenizer(resolve_model_path(MODEL)).encode(WARMUP_TEXT, add_special_tokens=False)
        assert len(ids) == int(done.group(1))
    finally:
        server.stop()


def test_skip_server_warmup_serves_without_it(launched):
    server = launched["skip"]
    try:
        server.wait_ready()
        log = server.log_text()
        assert "ready to roll" in log and "Warm-up" not in log, log
    finally:
        server.stop()


def test_a_failed_warmup_stops_the_server_with_status_1_and_one_sentence(launched):
    """The warm-up's forward outlasts --watchdog-timeout (a GPU kernel that hangs, say): the scheduler
    reports the stall and exits, the warm-up fails, and the server never says it is ready."""
    server = launched["stall"]
    try:
        code = server.proc.wait(90)
        log = server.log_text()
        assert code == 1, log
        failed = [line for line in log.splitlines() if "The warm-up request failed (" in line]
        assert len(failed) == 1 and failed[0].endswith(").") and ". " not in failed[0].split("failed (")[1], (
            log
        )
        assert re.search(r"ERROR sglang\.launch_server: .* The server shuts down\.", log), log
        assert "ready to roll" not in log and "Traceback" not in log, log
    finally:
        server.stop()
