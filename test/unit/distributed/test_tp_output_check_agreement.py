"""Under tensor parallelism the output checks' budget (constrained/output_check_budget.py) ends a request
at the same token on every rank. Its costs are wall time, each rank's own: a rank that ended a request
while another went on made the ranks' batches differ, and their collectives hung (the TP 2 server's
ambiguous-EBNF test: the scheduler's watchdog fired after 300 s). The ranks now agree on each check's
costs (MAX over the ranks, one all-reduce) before the budget reads them.

Two gloo ranks, each with a FinishChecker on the agreement group: a grammar that costs 1 ms a check on
rank 0 and 60 ms (over the 50 ms allowance) on rank 1, and a stop_regex whose search is cut for time on
rank 1 only. Without the agreement rank 0 never ends the first (it runs to its last check) and ends the
second on its match at the first token while rank 1 goes on."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.multi_rank import run_ranks
from sglang.test.multi_rank_workers import output_check_agreement

register_cpu_ci(est_time=4, suite="per-commit-cpu")


def test_tp_ranks_end_a_costly_request_at_the_same_token_alike():
    # Rank 1's grammar is over the 50 ms allowance at every check (two in a row end it: the second).
    costs = [[0.001] * 5, [0.06] * 5]
    r0, r1 = run_ranks(output_check_agreement, 2, costs, timeout=120)
    for case in ("grammar", "stop_regex"):
        assert r0[case] == r1[case], case
    n, reason = r0["grammar"]
    assert n == 2 and reason["status_code"] == 400 and reason["param"] == "ebnf"
    # The message gives the agreed cost (rank 1's 60 ms), the same text on both ranks.
    assert reason["message"].startswith("ebnf took 60 ms")
    # The search cut on rank 1 counts as cut on both: a first cut is the machine's (no match taken on
    # rank 0), the second in a row ends the request, naming the pattern rank 1 was cut at.
    n, reason = r0["stop_regex"]
    assert n == 2 and reason["param"] == "stop_regex" and reason["message"].startswith("stop_regex 'x' took")
    # One small all-reduce per check (measured 0.8-1 ms on the loaded 2-core VM); a loose bound against a
    # collective per request that waits on something else.
    assert r0["agree_s"] < 0.01
    print(f"agreement: {r0['agree_s'] * 1e6:.0f} us per check")
