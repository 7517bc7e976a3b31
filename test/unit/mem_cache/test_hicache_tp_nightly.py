"""The host tier at --tp-size 2 (two gloo ranks, each its own scheduler given the same requests, as rank
0's ticks give them; issue 58 item 4): a conversation evicted to host and hit again gives TP 1's tokens
and the oracle's logprobs, with the same host hits on both ranks; with the `file` disk tier, a restart
hits from disk on both ranks, and an entry that one rank lost is taken by neither (one rank alone taking
it would give it another tree, other slots and batches: the strict integrity check and the step-by-step
outputs would part). Nightly (~60 s):

    .venv/bin/python -m pytest -q test/unit/mem_cache/test_hicache_tp_nightly.py
"""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.hicache_tp_checks import conversation
from sglang.test.multi_rank import run_ranks

register_cpu_ci(est_time=90, suite="nightly-cpu")

PRESET = "tiny-qwen3-next"
# float32 on both sides: the ranks' reductions may add in another order than one rank's, which moves a
# logprob by ~1e-6 at this size (test_tp_engine.py's tolerance).
LOGPROB_TOL = 1e-4


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("hicache-tp"))
    one = conversation(0, 1, None, PRESET, folder)
    return one, run_ranks(conversation, 2, PRESET, folder, timeout=600)


def test_tp2_hits_host_and_disk_as_one_rank_does(runs, oracles):
    one, (r0, r1) = runs
    for rank in (r0, r1):
        assert len(rank["turns"]) == len(one["turns"])
        for got, want in zip(rank["turns"], one["turns"], strict=True):
            assert got["ids"] == want["ids"]
            assert max(abs(g - w) for g, w in zip(got["logprobs"], want["logprobs"], strict=True)) < LOGPROB_TOL
    for turn in r0["turns"]:
        ref = oracles[PRESET].token_logprobs(turn["prompt"] + turn["ids"], start=len(turn["prompt"]))
        assert (ref - __import__("torch").tensor(turn["logprobs"])).abs().max().item() < LOGPROB_TOL
    # Host: A's turn 2 loaded one checkpoint from host on each rank, the whole first turn but its last token.
    assert r0["host"] == r1["host"] == one["host"]
    assert r0["digest"] == r1["digest"] and r0["digest"][0][-1] is not None  # (host tree sizes included)
    assert r0["host"]["load_states"] >= 1
    host_turn = 9
    assert r0["turns"][host_turn]["cached"] == r1["turns"][host_turn]["cached"] >= 200
    # Disk: B hit from disk on both ranks; C (its files gone on rank 1 only) on neither.
    assert r0["disk"]["b_reads"] == r1["disk"]["b_reads"] >= 1
    assert r1["disk"]["c_files"] >= 1
    assert r0["disk"]["c_reads"] == r1["disk"]["c_reads"] == 0
    assert [t["cached"] for t in r0["turns"]] == [t["cached"] for t in r1["turns"]]
    assert one["disk"]["c_reads"] >= 1  # (at TP 1 nothing was lost: C hits from disk)
    # Both ranks' folders are under one storage folder: they split its filesystem's free space.
    assert r0["disk"]["ranks_sharing"] == r1["disk"]["ranks_sharing"] == 2 and one["disk"]["ranks_sharing"] == 1
