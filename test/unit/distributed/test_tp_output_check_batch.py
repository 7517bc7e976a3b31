"""Under tensor parallelism the ranks agree on a batch's output checks once per step, not once per
request (`FinishChecker.precheck`: one all-reduce of the batch's measures), and no fact of one rank alone
splits them: a grammar over its allowance, a stop_regex search cut for time, a custom logit processor
that failed, or a grammar whose compile failed, on one rank only, ends the request on every rank at the
same token with the same status and message.

Two gloo ranks run one batch (`sglang.test.output_check_workers`): without the batch agreement each
step ran one all-reduce per constrained request (measured 0.6-1 ms each); without the processor's flag in
it rank 0 went on with the request rank 1 ended (their batches then differ and the collectives hang);
without the queue's gather rank 0 admitted the request whose compile failed on rank 1."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.multi_rank import run_ranks
from sglang.test.output_check_workers import STEPS, batch_output_checks

register_cpu_ci(est_time=5, suite="per-commit-cpu")


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(batch_output_checks, 2, timeout=120)  # (one spawn of two ranks for both tests)


def test_one_agreement_per_step_and_no_rank_local_fact_splits_the_ranks(ranks):
    r0, r1 = ranks
    for r in (r0, r1):
        batched, alone = r["batched"], r["alone"]
        # One all-reduce per step while any request is measured (5 of the 6 are, until they end), where
        # each check alone took one per live measured request.
        assert batched["all_reduces"] == [1] * STEPS, batched["all_reduces"]
        assert alone["all_reduces"][:2] == [5, 5], alone["all_reduces"]
        assert batched["alone"] == 0 and alone["alone"] == sum(alone["all_reduces"])
        # Each token fed to a grammar once (the check used the batch's measure, it did not measure again).
        assert batched["grammar_fed"] == alone["grammar_fed"] == {"g_over": 3, "g_cheap": STEPS}
        # The same decisions as the checks alone.
        assert batched["ended"] == alone["ended"]
        # The processor's message crossed once: one object gather, at the step where it failed.
        assert batched["gathers"] == 1
    assert r0["batched"]["ended"] == r1["batched"]["ended"]
    ended = r0["batched"]["ended"]
    # A grammar over its 50 ms on rank 1 only: two tokens in a row over it end it on both, at token 3.
    n, reason = ended["g_over"]
    assert n == 3 and (reason["status_code"], reason["param"]) == (400, "ebnf")
    assert reason["message"].startswith("ebnf took 60 ms")
    # A search cut on rank 1 only counts as cut on both (rank 0 alone would stop at token 1 on "x").
    n, reason = ended["r_cut"]
    assert n == 2 and reason["param"] == "stop_regex" and reason["message"].startswith("stop_regex 'x' took")
    # A processor failing on rank 1 only ends the request on both at that token, with rank 1's message.
    n, reason = ended["c_fail"]
    assert n == 2 and (reason["status_code"], reason["param"]) == (400, "custom_logit_processor")
    assert reason["message"] == "The custom_logit_processor failed: rank 1."
    assert ended["r_match"] == (3, {"type": "stop", "matched": "x{3}"})
    assert ended["g_cheap"][1] == ended["p"][1] == {"type": "length", "length": STEPS}
    # A compile that failed on rank 1 only ends the request on both ranks with rank 1's words (one gather);
    # the other request is admitted on both.
    for r in (r0, r1):
        queue = r["grammar_queue"]
        assert queue["gathers"] == 1 and queue["ready"] == ["ok"] and queue["held"] == 1
    assert r0["grammar_queue"]["errors"] == r1["grammar_queue"]["errors"]
    message, field = r0["grammar_queue"]["errors"]["bad"]
    assert field == "ebnf" and message.startswith("ebnf could not be compiled:") and "on rank 1" in message


def test_a_refusal_or_an_uncut_overrun_on_one_rank_only_ends_alike(ranks):
    """A grammar that refuses a token on rank 1 only (another matcher build) ends the request on both ranks
    at that token with rank 1's 500 (without the refusal in the agreement, rank 0 went on: its batches
    then differ); a stop_regex search that ran 80 ms past its 50 ms on rank 1 only without being cut counts
    as over the allowance on both, so the cut at the next token is the second in a row and ends it there
    (without it, the uncut overrun reset the count and the request went on past token 3)."""
    r0, r1 = ranks
    assert r0["refusal_and_overrun"] == r1["refusal_and_overrun"]
    ended = r0["refusal_and_overrun"]
    n, reason = ended["g_refuse"]
    assert n == 2 and reason["status_code"] == 500 and "does not allow the token 7" in reason["message"]
    n, reason = ended["r_slow"]
    assert n == 3 and reason["param"] == "stop_regex" and reason["message"].startswith("stop_regex 'z' took")


def test_a_verify_steps_tokens_are_agreed_at_once_and_end_alike(ranks):
    """An NGRAM verify step of stop_regex requests that accept both drafts: every token the step may
    commit is measured before the commit and agreed in ONE all-reduce (before, only each request's first
    token was: each later token's check measured and agreed alone, one all-reduce per token per
    request, 13 more here), and both ranks end each request at the same token and commit the same
    tokens: a search cut at the first token on rank 1 only is cut on both (rank 0 alone would have
    stopped there on "x"), so the request ends at its second token, where both ranks match; a search cut
    at the second token on rank 1 only makes both commit up to it and not the third (rank 0 alone, three):
    the cut token itself is committed, as its own cost decides only what comes after it."""
    r0, r1 = ranks
    for r in (r0, r1):
        verify = r["verify"]
        assert verify["all_reduces"] == 1 and verify["agreements"] == 1 and verify["alone"] == 0, verify
    assert r0["verify"]["ended"] == r1["verify"]["ended"]
    ended = r0["verify"]["ended"]
    assert ended["r_match"] == (4, {"type": "stop", "matched": "^x{4}$"})  # (its third token dropped)
    assert ended["r_cut"] == (4, {"type": "stop", "matched": "x"})
    assert ended["r_stop_id"] == (4, {"type": "stop", "matched": 8})
    for rid in ("r_far0", "r_far1", "r_far2", "r_far3", "plain"):
        assert ended[rid] == (5, None), rid
    assert ended["r_nodraft"] == (3, None) and ended["r_trunc"] == (4, None)
