"""Upstream's per-request speculative fields of meta_info (`spec_meta_info`), from the counts the NGRAM
commit keeps (`Req.spec_counts`): every forward after a request's first token commits one token plus the
drafts it accepted, so the verify count, the histogram and the accept length follow from the accepted
and proposed drafts and the completion tokens."""

from __future__ import annotations

from sglang.srt.managers.tokenizer_output import spec_meta_info
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")


def test_fields_follow_from_the_counts():
    # 20 tokens: the first, then 9 forwards: 3 accepted 2 drafts, 1 accepted 4, 5 accepted none.
    counts = [30, 0, 3, 0, 1]  # proposed, then at index k the verifies that accepted k
    meta = spec_meta_info(counts, completion_tokens=20)
    assert meta["spec_verify_ct"] == 9  # 20 - 1 - 10
    assert meta["spec_accept_histogram"] == [5, 0, 3, 0, 1]
    assert sum(meta["spec_accept_histogram"]) == meta["spec_verify_ct"]
    assert sum(k * n for k, n in enumerate(meta["spec_accept_histogram"])) == 10
    assert meta["spec_accept_length"] == 20 / 9
    assert meta["spec_accept_rate"] == 10 / 30
    assert meta["spec_num_correct_drafts"] == meta["spec_accepted_drafts"] == 10
    assert meta["spec_num_proposed_drafts"] == meta["spec_proposed_drafts"] == 30


def test_a_request_that_never_verified_reports_its_decode_steps():
    meta = spec_meta_info([0], completion_tokens=5)  # four plain decode steps, no draft ever
    assert meta["spec_verify_ct"] == 4 and meta["spec_accept_histogram"] == [4]
    assert meta["spec_accept_rate"] == 0.0 and meta["spec_accept_length"] == 5 / 4


def test_nothing_before_the_second_token():
    assert spec_meta_info([0], completion_tokens=1) == {}
    assert spec_meta_info([0], completion_tokens=0) == {}
