"""The shape warm-up through a real server (on CUDA by default; SGLANG_SHAPE_WARMUP=on runs it on the
CPU): its prompts, lengths from the server's own limits, run after the warm-up request and before
"ready to roll", count in no metric and leave nothing cached."""

from __future__ import annotations

import re

import requests

from sglang.srt.entrypoints.server_warmup import CONCURRENT_PROMPTS, warmup_prompt_lengths
from sglang.test.ci_register import register_cpu_ci
from sglang.test.test_utils import ServerProcess

register_cpu_ci(est_time=30, suite="nightly-cpu")


def test_the_shape_warmup_runs_before_ready_counts_nowhere_and_leaves_nothing_cached():
    server = ServerProcess(
        ["--model-path", "tiny-qwen3-next", "--chunked-prefill-size", "64", "--enable-metrics"],
        env={"SGLANG_SHAPE_WARMUP": "on"},
    )
    try:
        server.wait_ready()
        log = server.log_text()
        done = re.search(r"Shape warm-up done in [\d.]+ s: prompts of ([\d, ]+) tokens, then (\d+) of", log)
        assert done, log
        info = requests.get(server.base_url + "/get_server_info", timeout=10).json()
        expected = warmup_prompt_lengths(64, info["max_prefill_tokens"], info["max_req_input_len"],
                                         info["max_total_num_tokens"])  # fmt: skip
        assert expected == [1, 2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 64 + 17]  # (the pool holds them all)
        assert [int(n) for n in done.group(1).split(", ")] == expected
        assert int(done.group(2)) == CONCURRENT_PROMPTS
        order = [log.index(line) for line in ("Warm-up request done", "Shape warm-up done", "ready to roll")]
        assert order == sorted(order), log
        metrics = requests.get(server.base_url + "/metrics", timeout=10).text
        prompt_tokens = [m for m in metrics.splitlines() if m.startswith("sglang:prompt_tokens_total")]
        assert prompt_tokens and all(float(line.split()[-1]) == 0 for line in prompt_tokens), prompt_tokens
        state = info["internal_states"][0]
        assert state["token_usage"]["held_by_tree"] == 0 and state["mamba_usage"]["held_by_tree"] == 0, state
    finally:
        server.stop()
