"""Rank functions for test/unit/distributed/test_tp_runtime.py (spawned by `multi_rank.run_ranks`, so
importable by name): the scheduler's agreement on an outcome, the ranks' agreement on sampled tokens,
the start-up comparison of the nodes' environments, and --dist-timeout on the model's groups (last: it leaves the TP group broken)."""

from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

# The model groups' timeout here, and how long rank 1 stays away from a collective rank 0 entered.
GROUP_TIMEOUT_S = 1
AWAY_S = 4


def runtime_checks(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.managers.scheduler_components.tp_broadcast import ParallelRank, TpBroadcast

    # (the default group waits longer: only the model groups are given the short timeout)
    ps.init_distributed_environment("gloo", world_size, rank, init_method, timedelta(seconds=120))
    ps.initialize_model_parallel(world_size, 1, timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    where = ParallelRank(rank, world_size, 1, None, init_method, "gloo", 120)
    tp = TpBroadcast(where, dist.new_group(list(range(world_size)), backend="gloo"), watch=None)
    out: dict[str, Any] = {
        "none": tp.agree_outcome(None),
        "one": tp.agree_outcome("disk full" if rank == 1 else None),
        "all": tp.agree_outcome("bad name"),
        "processor": _processor_outcome(rank, tp),
        "tokens": _sampled_tokens(rank),
        "env": _env_refusals(rank, tp),
    }
    if rank == 0:  # rank 1 never joins this all-reduce: the TP group's timeout must end it
        start = time.monotonic()
        try:
            ps.get_tp_group().all_reduce(torch.ones(1))
            out["failed_after_s"] = None
        except Exception:  # noqa: BLE001 - gloo's timeout error, whatever its type
            out["failed_after_s"] = time.monotonic() - start
    else:
        time.sleep(AWAY_S)
    return out


def _processor_outcome(rank: int, tp: Any) -> list[Any]:
    """A request's custom logit processor that loads on rank 0 and not on rank 1 (its code may read the
    rank, its host's files...: here rank 1's payload is cut short), then one that loads on both: the
    (loaded, error) each rank takes."""
    from sglang.srt.sampling.custom_logit_processor import (
        DisallowedTokensLogitsProcessor,
        load_processor_agreed,
    )

    payload = DisallowedTokensLogitsProcessor.to_str()
    outcomes = []
    for mine in (payload if rank == 0 else payload[:-8], payload):
        processor, error = load_processor_agreed(mine, tp.agree_outcome)
        outcomes.append((processor is not None, error))
    return outcomes


def _env_refusals(rank: int, tp: Any) -> list[str | None]:
    """`check_same_flags` with the same flags (but --node-rank, a node's own) where rank 1's node sets,
    in turn: nothing, SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP=0.1 (rank 0's is the default 0.2), the custom
    logit processor secret: each rank's refusal (None: started)."""
    from sglang.srt.environ import envs
    from sglang.srt.managers.scheduler_components.tp_broadcast import ParallelGroupError

    args = SimpleNamespace(public_dict=lambda: {"tp_size": 2, "node_rank": rank})
    out: list[str | None] = []
    for var, value in [
        (envs.SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP, None),
        (envs.SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP, 0.1),
        (envs.SGLANG_LOGIT_PROCESSOR_SECRET, "s3cret-of-node-1"),
    ]:
        with var.override(value if rank == 1 else None):
            try:
                tp.check_same_flags(args)
                out.append(None)
            except ParallelGroupError as e:
                out.append(str(e))
    return out


def _sampled_tokens(rank: int) -> dict[str, Any]:
    """Rank r sampled [5, 7 + r]: untouched without a grammar; rank 0's smaller id on every rank with
    one; an error naming row 1 on every rank under the strict check."""
    import os
    from types import SimpleNamespace

    import torch

    from sglang.srt.model_executor.model_runner import agree_on_tokens

    os.environ["SGLANG_ENABLE_STRICT_TP_TOKEN_CHECK"] = "0"
    os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"  # (not this check's switch)
    ids = torch.tensor([5, 7 + rank])
    plain = SimpleNamespace(vocab_mask=None, custom_logit=None)
    grammar = SimpleNamespace(vocab_mask=torch.ones(2, 1), custom_logit=None)
    out: dict[str, Any] = {
        "plain": agree_on_tokens(ids, plain).tolist(),
        "grammar": agree_on_tokens(ids, grammar).tolist(),
    }
    os.environ["SGLANG_ENABLE_STRICT_TP_TOKEN_CHECK"] = "1"
    try:
        agree_on_tokens(ids, plain)
        out["strict"] = None
    except RuntimeError as e:
        out["strict"] = str(e)
    return out
