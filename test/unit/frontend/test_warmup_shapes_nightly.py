"""The shape warm-up through a real server (on CUDA by default; SGLANG_SHAPE_WARMUP=on runs it on the
CPU): its prompts, lengths from the server's own limits, run after the warm-up request and before
"ready to roll", count in no metric (the tokenizer's nor the scheduler's) and leave nothing cached, on
the device, on host or on disk."""

from __future__ import annotations

import re

import pytest
import requests

from sglang.srt.entrypoints.server_warmup import CONCURRENT_PROMPTS, warmup_prompt_lengths
from sglang.test.ci_register import register_cpu_ci
from sglang.test.hicache_checks import hicache_harness
from sglang.test.scheduler_harness import token_ids
from sglang.test.test_utils import ServerProcess

register_cpu_ci(est_time=45, suite="nightly-cpu")


def test_the_shape_warmup_runs_before_ready_counts_nowhere_and_leaves_nothing_cached(tmp_path):
    # With the host and disk tiers (write_through: every checkpoint would be backed up at once): the
    # warm-up's fixed prompts went to disk, and the next start's warm-up hit them (704 of 1192 prompt
    # tokens from the cache) instead of compiling its long shapes.
    server = ServerProcess(
        ["--model-path", "tiny-qwen3-next", "--chunked-prefill-size", "64", "--enable-metrics",
         "--enable-hierarchical-cache", "--hicache-storage-backend", "file"],
        env={"SGLANG_SHAPE_WARMUP": "on", "SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(tmp_path)},
    )  # fmt: skip
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
        # The tokenizer's counts and the scheduler's (realtime tokens and queue times counted the warm-up's
        # 1.2k prompt tokens and 18 requests).
        names = ("sglang:prompt_tokens_total", "sglang:realtime_tokens_total", "sglang:queue_time_seconds_count")
        for name in names:
            lines = [m for m in metrics.splitlines() if m.startswith(name)]
            assert lines and all(float(line.split()[-1]) == 0 for line in lines), lines
        state = info["internal_states"][0]
        assert state["token_usage"]["held_by_tree"] == 0 and state["mamba_usage"]["held_by_tree"] == 0, state
        assert set(state["counters"].values()) == {0}, state["counters"]
        assert not any(state["realtime_tokens"].values()), state["realtime_tokens"]
        # Nothing went to host or disk.
        assert [state["hicache"].get(k, 0) for k in ("backup_states", "backup_tokens", "load_states")] == [0] * 3
        assert not [p for p in tmp_path.rglob("*") if p.is_file()]
    finally:
        server.stop()


@pytest.mark.parametrize("policy", ["write_through", "write_back", "write_through_selective"])
def test_the_host_tier_takes_nothing_of_the_warmups_namespace(policy):
    """Under every write policy: a conversation sent as the warm-up's (its namespace kept off host) and one
    sent as a user's, the same prompt in each, each hit once more (write_through_selective's second hit),
    then 8 others push both off the device (6 slots). The user's reaches the host tier (the control: the
    setup backs up), the warm-up's does not, and no load is tried for it."""
    h = hicache_harness("tiny-qwen3-next", "extra_buffer_lazy", policy)
    try:
        tree = h.sched.tree_cache
        prompt = token_ids(200, seed=1)
        for ns, warmup in (("warmup-test", True), ("user", False)):
            first = h.generate(prompt, max_new_tokens=4, extra_key=ns, warmup=warmup)
            h.generate(prompt + first.output_ids + token_ids(8, seed=50), max_new_tokens=1, extra_key=ns,
                       warmup=warmup)  # fmt: skip
        for i in range(8):
            h.generate(token_ids(300, seed=10 + i), max_new_tokens=4)
            h.sched.check_integrity()
        on_host = {ns: tree.host_tree._walk(prompt, ns)[1] for ns in ("warmup-test", "user")}
        assert on_host["user"] > 0 and on_host["warmup-test"] == 0, on_host
        assert tree.off_host == {"warmup-test"}
        h.flush_and_check_empty()
        assert tree.off_host == set()  # (a reset forgets it: the next warm-up's is a new namespace)
    finally:
        h.shutdown()
