"""Pool sizes under tensor parallelism where the ranks find different free memory, run on each rank by
`sglang.test.multi_rank.run_ranks`: each rank's memory budget is the one the test gives it (as on GPUs,
where free memory can differ per rank), and the ModelRunner must still build the same pools on every
rank, the smallest any rank planned (`pool_sizing.agree_across_ranks`)."""

from __future__ import annotations

from typing import Any

from sglang.srt import distributed as ps

FIELDS = ("max_total_tokens", "max_mamba_cache_size", "max_running_requests")


def pools_with_memory(
    rank: int, world_size: int, init_method: str, preset: str, memory_by_rank: list[int]
) -> dict[str, Any]:
    """What this rank planned alone with `memory_by_rank[rank]` bytes of device memory, the sizes its
    runner took, and the pools it allocated."""
    from sglang.srt.mem_cache import pool_sizing
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs

    ps.init_distributed_environment("gloo", world_size, rank, init_method)
    ps.initialize_model_parallel(world_size, 1)
    real, agree = pool_sizing.cache_budget_bytes, pool_sizing.agree_across_ranks

    def budget(device, fraction, weight_bytes, device_memory=None):
        return real(device, fraction, weight_bytes, memory_by_rank[rank])

    pool_sizing.cache_budget_bytes = budget  # (compute_pool_sizes reads it by the module's name)
    try:
        args = ServerArgs(model_path=preset, mem_fraction_static=0.02, random_seed=0, dtype="float32")
        runner = ModelRunner(args)
        weights = runner.memory_bytes["weights"]
        pool_sizing.agree_across_ranks = lambda sizes: sizes  # (this rank's plan alone)
        planned = pool_sizing.compute_pool_sizes(args, runner.arch, weights)
        return {
            "planned": {f: getattr(planned, f) for f in FIELDS},
            "taken": {f: getattr(runner.pool_sizes, f) for f in FIELDS},
            "kv_tokens": runner.token_to_kv_pool.size,
            "mamba_slots": runner.mamba_pool.size,
        }
    finally:
        pool_sizing.cache_budget_bytes, pool_sizing.agree_across_ranks = real, agree
        ps.destroy_model_parallel()
