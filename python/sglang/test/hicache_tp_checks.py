"""The host tier under tensor parallelism, run on each rank by `sglang.test.multi_rank.run_ranks` (or alone
at TP 1): every rank builds a scheduler (the harness's) in one TP group and is given the same requests
in the same order, as rank 0's ticks give them to a server's ranks. Shared by test_hicache_tp_nightly.py."""

from __future__ import annotations

import os
from typing import Any

from sglang.test.scheduler_harness import SchedulerHarness, token_ids

ARGS = dict(
    mamba_scheduler_strategy="extra_buffer_lazy",
    max_mamba_cache_size=6,
    max_total_tokens=2048,
    max_running_requests=2,
    enable_hierarchical_cache=True,
    hicache_write_policy="write_through",
    hicache_ratio=8,
    random_seed=0,
)


def _harness(rank: int, world: int, init_method: str | None, preset: str, **kw: Any) -> SchedulerHarness:
    """A scheduler on this rank, in its TP group when `world` > 1 (joined once per process)."""
    from sglang.srt.managers.scheduler_components.tp_broadcast import ParallelRank, join_parallel_group
    from sglang.srt.server_args import ServerArgs

    args = {**ARGS, "tp_size": world, **kw}
    tp = None
    if world > 1:
        import torch.distributed as dist

        if not dist.is_initialized():
            place = ParallelRank(rank, world, 1, None, init_method, "gloo", 120)
            _harness.tp = join_parallel_group(place, ServerArgs(model_path=preset, **args))
        tp = _harness.tp
    h = SchedulerHarness(preset, **args)
    if tp is not None:
        h.sched.init_parallel(tp, None)
        h.sched._muted = False  # (every rank's outputs go to its in-process outbox: each is checked)
    return h


def _turn(h: SchedulerHarness, prompt: list[int], n: int) -> dict:
    out = h.generate(prompt, max_new_tokens=n)
    assert out.finished_reason is not None
    return {"prompt": prompt, "ids": out.output_ids, "logprobs": out.logprobs, "cached": out.cached_tokens}


def conversation(rank: int, world: int, init_method: str | None, preset: str, storage_dir: str) -> dict:
    """Host tier: turn 1 of conversation A, 8 others push its checkpoints off the device (6 slots), its
    turn 2 hits from host. Disk tier (`file`, a restart on the same folder): turns 1 of B and C are
    written to disk by server 1; before server 2 starts, rank 1 (only) loses C's files; server 2 serves
    turn 2 of B (a disk hit on every rank) and of C (a hit on rank 0 alone: no rank may take it).
    Returns every turn's tokens, logprobs and cached tokens, and this rank's host and disk counts."""
    from sglang.srt.environ import envs

    turns: list[dict] = []
    h = _harness(rank, world, init_method, preset)
    try:
        tree = h.sched.tree_cache
        a = token_ids(200, seed=1)
        turns.append(_turn(h, a, 4))
        for i in range(8):
            turns.append(_turn(h, token_ids(300, seed=10 + i), 4))
        turns.append(_turn(h, a + turns[0]["ids"] + token_ids(20, seed=99), 6))
        h.sched.check_integrity()
        host = {k: tree.controller.stats[k] for k in ("load_states", "host_hit_tokens", "backup_states")}
        digest = [list(h.sched.rank_digest())]  # (what the ranks compare when idle: the host tree's sizes too)
        h.flush_and_check_empty()
    finally:
        h.shutdown()
    disk: dict[str, Any] = {}
    with envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.override(storage_dir):
        h = _harness(rank, world, init_method, preset, hicache_storage_backend="file")
        try:
            b, c = token_ids(150, seed=2), token_ids(150, seed=3)
            tb, tc = _turn(h, b, 4), _turn(h, c, 4)
            turns += [tb, tc, _turn(h, token_ids(30, seed=5), 1)]  # (its batch runs the disk writes)
            st = h.sched.tree_cache.storage
            c_files = st._hits(c + tc["ids"], None)
            disk["ranks_sharing"] = st.ranks
        finally:
            h.shutdown()
        if rank == 1:
            for length, name in c_files.items():
                os.unlink(st._path(name, length, st.index[name][2]))
        h = _harness(rank, world, init_method, preset, hicache_storage_backend="file")
        try:
            stats = h.sched.tree_cache.controller.stats
            turns.append(_turn(h, b + tb["ids"] + token_ids(20, seed=98), 6))
            disk["b_reads"] = stats["disk_reads"]
            turns.append(_turn(h, c + tc["ids"] + token_ids(20, seed=97), 6))
            disk["c_reads"] = stats["disk_reads"] - disk["b_reads"]
            disk["c_files"] = len(c_files)
            h.sched.check_integrity()
            digest.append(list(h.sched.rank_digest()))
            h.flush_and_check_empty()
        finally:
            h.shutdown()
    return {"turns": turns, "host": host, "disk": disk, "digest": digest}
