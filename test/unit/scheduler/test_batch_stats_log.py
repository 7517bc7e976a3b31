"""Upstream's batch log lines (`batch_stats_log.py`): a "Prefill batch." line per prefill batch with its new
and cached tokens, a "Decode batch." line every --decode-log-interval decode batches with the running
requests and the generation throughput; and the flag's check."""

from __future__ import annotations

import logging
import re

import pytest

from sglang.srt.managers.scheduler_components import batch_stats_log
from sglang.srt.managers.scheduler_components.batch_stats_log import BatchStatsLog
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=6, suite="per-commit-cpu")

LOGGER = "sglang.srt.managers.scheduler"


def _fields(line: str) -> dict[str, float]:
    return {k: float(v) for k, v in re.findall(r"([#\w][\w -]*?(?:\(token/s\))?): ([\d.]+)", line)}


def test_prefill_lines_count_new_and_cached_tokens_and_decode_lines_come_every_interval(caplog):
    h = SchedulerHarness("tiny-qwen3-next", decode_log_interval=3, disable_overlap_schedule=True)
    prompt = token_ids(150, seed=1)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        h.generate(prompt, max_new_tokens=8)  # 1 prefill, 7 decode batches: 2 decode lines
        h.generate(prompt + token_ids(10, seed=2), max_new_tokens=1)  # a prefix hit
    lines = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    prefill = [_fields(m) for m in lines if m.startswith("Prefill batch.")]
    decode = [_fields(m) for m in lines if m.startswith("Decode batch.")]
    assert [p["#new-seq"] for p in prefill] == [1, 1]
    assert (prefill[0]["#new-token"], prefill[0]["#cached-token"]) == (150, 0)
    assert prefill[1]["#cached-token"] > 0
    assert prefill[1]["#new-token"] + prefill[1]["#cached-token"] == 160
    assert len(decode) == 2
    for d in decode:
        assert d["#running-req"] == 1 and d["gen throughput (token/s)"] > 0
        assert 0 < d["token usage"] <= 1 and 0 < d["mamba usage"] <= 1 and d["#token"] > 150


def test_above_info_nothing_is_computed(caplog, monkeypatch):
    def refuse(self):
        raise AssertionError("usage computed with the log off")

    monkeypatch.setattr(BatchStatsLog, "usage", refuse)
    h = SchedulerHarness("tiny-qwen3-next", decode_log_interval=1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        h.generate(token_ids(20, seed=3), max_new_tokens=4)
    assert not [r for r in caplog.records if "batch." in r.getMessage()]


def test_idle_time_does_not_count_in_the_throughput(caplog, monkeypatch):
    """A window opens at the first decode batch after idle: a clock that jumps 1,000 s while the scheduler
    is idle between two requests leaves the second request's line at the steps' own pace."""
    clock = [0.0]

    def tick():
        clock[0] += 0.001  # every read: 1 ms
        return clock[0]

    monkeypatch.setattr(batch_stats_log.time, "monotonic", tick)
    h = SchedulerHarness("tiny-qwen3-next", decode_log_interval=4, disable_overlap_schedule=True)
    with caplog.at_level(logging.INFO, logger=LOGGER):
        h.generate(token_ids(20, seed=4), max_new_tokens=3)  # 2 decode batches: no line, a window open
        clock[0] += 1000.0  # idle
        h.generate(token_ids(20, seed=5), max_new_tokens=6)  # 5 decode batches: one line
    (line,) = [_fields(r.getMessage()) for r in caplog.records if r.getMessage().startswith("Decode batch.")]
    assert line["gen throughput (token/s)"] > 100  # 4 tokens over 4 ms steps; 0.004 tok/s with the idle time


def test_the_interval_must_be_positive():
    with pytest.raises(ServerArgsError, match="--decode-log-interval"):
        ServerArgs(model_path="tiny-qwen3-next", decode_log_interval=0)


def test_the_cuda_graph_field_says_whether_a_graph_serves_the_batch(caplog):
    """`cuda graph` asks the graph runner about the batch itself: a verify that runs eagerly (not of the
    verify graphs' width) says False though a decode graph of its size exists."""
    from types import SimpleNamespace

    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    sched = SchedulerHarness("tiny-qwen3-next").sched
    log = BatchStatsLog(
        1, sched.token_allocator, sched.req_to_token_pool.mamba_allocator, sched.tree_cache,
        graph_check=lambda fb: fb.verify_width == 6,  # a runner whose verify graphs are 6 wide
    )  # fmt: skip
    graphs = []
    with caplog.at_level(logging.INFO, logger=LOGGER):
        for width in (0, 6, 0):  # the first launch opens the window
            fb = SimpleNamespace(verify_width=width)
            batch = SimpleNamespace(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=3, forward_batch=fb)
            log.on_launch(batch, running=3, queued=0)
        graphs = re.findall(r"cuda graph: (\w+)", caplog.text)
    assert graphs == ["True", "False"]
