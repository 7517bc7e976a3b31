"""A weight update that fails on one of two TP ranks while a batch is in flight (issue 54, review
finding 2): every rank finishes its batches in flight before the ranks vote, so that after the refusal
both ranks hold the same requests and keep serving in step. Three paths: a payload only rank 1 cannot
read (/update_weights_from_tensor), a disk load that failed on rank 1 (/update_weights_from_disk) and a
receive that failed on rank 1 (/update_weights_from_distributed); the workers are in
`sglang.test.tp_weight_failure_checks`. Before, the failing rank voted at once with the batch still in
flight and then built another batch than rank 0 (its finished request still running): the model's
all-reduce failed."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.multi_rank import run_ranks
from sglang.test.tp_weight_failure_checks import CASES, weight_failure_checks

register_cpu_ci(est_time=8, suite="per-commit-cpu")


def test_a_weight_update_failing_on_one_rank_leaves_the_ranks_in_step():
    r0, r1 = run_ranks(weight_failure_checks, 2, timeout=120)
    for case in CASES:
        a, b = r0[case], r1[case]
        assert a["outputs"] == b["outputs"], case
        assert [len(o) for o in a["outputs"]] == [4, 9], case  # (both requests served to the end)
        assert a["digest"] == b["digest"], case  # (batches built, pools and tree: the same)
        assert a["replies"] == b["replies"], case  # (the agreed refusal, rank 1's reason naming it)
        assert len(a["replies"]) == 1 and "(on TP rank 1; every rank keeps what it had)" in a["replies"][0]
