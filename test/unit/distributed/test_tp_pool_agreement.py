"""Pool sizes under tensor parallelism agree across the ranks (issue 54): on GPUs the free memory each
rank finds can differ (another process's allocations, the driver's), and each rank sizing its pools from
its own would give the ranks different pools, so that their schedulers (which must decide alike) diverge
or the start-up check refuses the server. Each rank's memory budget is reduced with MIN over the TP group
before the sizes are derived from it.

Two gloo ranks whose memory budget differs (injected: 2.0 GiB and 1.5 GiB of "device memory" at
--mem-fraction-static 0.02, no size flag given) plan different pools alone and both build the plan of
the rank with less memory; where one rank's budget holds no cache (16 MiB), both refuse in the same
sentence instead of one waiting for the other until the group's timeout."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.multi_rank import run_ranks
from sglang.test.tp_pool_checks import pools_with_memory

register_cpu_ci(est_time=8, suite="per-commit-cpu")

GIB = 1 << 30


def test_ranks_with_different_free_memory_build_the_smallest_pools_or_refuse_alike():
    # (One spawn for both cases; a rank refusing alone would leave the other in a collective until the
    # group's timeout, so the wait is bounded well below that.)
    r0, r1 = run_ranks(
        pools_with_memory, 2, "tiny-qwen3-next", [[2 * GIB, 3 * GIB // 2], [2 * GIB, 16 << 20]], timeout=120
    )
    a0, a1 = r0[0], r1[0]
    # Alone, the rank with less memory plans fewer KV tokens and mamba slots (the premise).
    assert a1["planned"]["max_total_tokens"] < a0["planned"]["max_total_tokens"]
    assert a1["planned"]["max_mamba_cache_size"] < a0["planned"]["max_mamba_cache_size"]
    # Both take the plan of the rank with the least memory (its budget is the group's MIN), and allocate
    # it; with each rank's own budget rank 0 would take its larger plan.
    for r in (a0, a1):
        assert r["taken"] == a1["planned"]
        assert r["kv_tokens"] == a1["planned"]["max_total_tokens"]
        assert r["mamba_slots"] == a1["planned"]["max_mamba_cache_size"]
    # Rank 1's 16 MiB leave no cache budget after the weights: both ranks refuse, with rank 1's reason.
    b0, b1 = r0[1], r1[1]
    assert b0 == b1 and b0["error"].startswith("--mem-fraction-static 0.02 leaves no memory for the caches")
