"""Speculative decoding with the host tier (`--enable-hierarchical-cache` with `--speculative-algorithm`,
issue 58): a verify's KV allocation that evicts a cached conversation backs it up to host before the
verify writes the pages it is handed, so the conversation's host hit gives plain decoding's outputs.
Every strategy, NGRAM and NEXTN, and NEXTN's acceptance after a host hit: test_hicache_spec_nightly.py."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.hicache_spec_checks import NGRAM, run_script, small_evicted_while_verifying

register_cpu_ci(est_time=3, suite="per-commit-cpu")  # measured 2.3-2.5 s alone (load ~2.5)


def test_a_backup_evicted_by_a_verify_runs_before_the_verify_writes_its_pages():
    """write_back, a 256-token KV pool: B's verifies evict A's path (A is backed up to host then); A's
    turn 2 hits host and equals plain decoding's tokens (greedy: the same argmax after the same tokens).
    Before the fix the verify batch sealed no host copies: the backup ran after the verify had written
    B's KV into A's pages, and A's turn 2 diverged from plain decoding (measured on every strategy)."""
    kw = dict(max_total_tokens=256, hicache_write_policy="write_back")
    script = small_evicted_while_verifying
    plain = run_script("tiny-qwen3-next", "no_buffer", False, {}, script, **kw)
    truth = {tuple(r[0]): r[0] + r[1] for r in plain["requests"]}
    spec = run_script("tiny-qwen3-next", "no_buffer", True, NGRAM, script, truth=truth, **kw)
    assert [r[1] for r in spec["requests"]] == [r[1] for r in plain["requests"]]
    turn2 = spec["requests"][-1]
    assert turn2[4] == 1 and turn2[2] > plain["requests"][-1][2], turn2  # a host hit, deeper than plain's
    assert spec["spec"]["accepted_tokens"] > 0 and turn2[3]["accepted_tokens"] > 0, spec["spec"]
