"""Pool sizes under tensor parallelism where the ranks find different free memory, run on each rank by
`sglang.test.multi_rank.run_ranks`: each rank's memory budget is the one the test gives it (as on GPUs,
where free memory can differ per rank), and the ModelRunner must still build the same pools on every
rank, those of the rank with the least memory (`pool_sizing.smallest_across_ranks`: the budget's MIN
over the group), or refuse on every rank alike."""

from __future__ import annotations

from typing import Any

from sglang.srt import distributed as ps

FIELDS = ("max_total_tokens", "max_mamba_cache_size", "max_running_requests")


def pools_with_memory(
    rank: int, world_size: int, init_method: str, preset: str, cases: list[list[int]]
) -> list[dict[str, Any]]:
    """Per case (device memory per rank): what this rank planned alone with its memory, the sizes its
    runner took and the pools it allocated; or the ServerArgsError its runner raised."""
    from sglang.srt.mem_cache import pool_sizing
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang.srt.server_args import ServerArgs, ServerArgsError

    ps.init_distributed_environment("gloo", world_size, rank, init_method)
    ps.initialize_model_parallel(world_size, 1)
    real = pool_sizing.cache_budget_bytes
    smallest = pool_sizing.smallest_across_ranks
    out = []
    try:
        for memory_by_rank in cases:

            def budget(device, fraction, weight_bytes, device_memory=None, mine=memory_by_rank[rank]):
                return real(device, fraction, weight_bytes, mine)

            pool_sizing.cache_budget_bytes = budget  # (compute_pool_sizes reads it by the module's name)
            args = ServerArgs(model_path=preset, mem_fraction_static=0.02, random_seed=0, dtype="float32")
            try:
                runner = ModelRunner(args)
            except ServerArgsError as e:
                out.append({"error": str(e)})
                continue
            weights = runner.memory_bytes["weights"]
            pool_sizing.smallest_across_ranks = lambda value: value  # (this rank's plan alone)
            planned = pool_sizing.compute_pool_sizes(args, runner.arch, weights)
            pool_sizing.smallest_across_ranks = smallest
            out.append({
                "planned": {f: getattr(planned, f) for f in FIELDS},
                "taken": {f: getattr(runner.pool_sizes, f) for f in FIELDS},
                "kv_tokens": runner.token_to_kv_pool.size,
                "mamba_slots": runner.mamba_pool.size,
            })  # fmt: skip
        return out
    finally:
        pool_sizing.cache_budget_bytes = real
        pool_sizing.smallest_across_ranks = smallest
        ps.destroy_model_parallel()
