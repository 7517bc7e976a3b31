"""A weight update that fails on one TP rank while a batch is in flight, run on each rank by
`sglang.test.multi_rank.run_ranks` with a real `Scheduler` per rank (issue 54, review finding 2).

Each case starts two requests, steps until the batch in flight holds the last token of the shorter one,
(its 4th, a stop token), then makes the update fail on rank 1 only, before its write: a payload rank 1 cannot read
(/update_weights_from_tensor), a disk load that failed on rank 1 (/update_weights_from_disk) and a
receive that failed on rank 1 (/update_weights_from_distributed). Every rank must finish its batches in
flight before its vote: a rank that votes first still holds the finished request in its running batch
and builds another batch than the others (the model's all-reduces then fail or wait)."""

from __future__ import annotations

import os
from typing import Any

# (the ranks' scheduler digests are compared each time they go idle: `TpBroadcast.agree`)
os.environ["SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE"] = "1"

# Seconds a model collective may wait for the other rank: a desync fails within it, not torch's 30 min.
GROUP_TIMEOUT_S = 20
CASES = ("tensor", "disk", "distributed")


def weight_failure_checks(rank: int, world_size: int, init_method: str) -> dict[str, Any]:
    """Per case: the reply the scheduler sent, then the outputs and digest once both ranks went idle."""
    from sglang.srt.managers.io_struct import (
        UpdateWeightFromDiskReqInput,
        UpdateWeightsFromDistributedReqInput,
        UpdateWeightsFromTensorReqInput,
    )
    from sglang.srt.managers.scheduler_components.tp_broadcast import ParallelRank, join_parallel_group
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.multiprocessing_serializer import MultiprocessingSerializer
    from sglang.test.scheduler_harness import SchedulerHarness

    flags = dict(tp_size=world_size, max_total_tokens=2048, max_mamba_cache_size=16, random_seed=0)
    place = ParallelRank(rank, world_size, 1, None, init_method, "gloo", GROUP_TIMEOUT_S)
    tp = join_parallel_group(place, ServerArgs(model_path="tiny-qwen3-next", **flags))
    h = SchedulerHarness("tiny-qwen3-next", **flags)
    sched = h.sched
    sched.init_parallel(tp, None)
    sched._muted = False  # (rank 1's outputs and replies too, collected here to compare with rank 0's)
    assert sched.enable_overlap  # (the batch in flight is what the ranks must finish alike)
    # The short request ends on a stop token (its 4th greedy one), which no scheduler foresees: a rank
    # that has not processed the batch holding it still runs it in the next batch.
    first = h.generate([5, 6, 7, 8, 9] * 3, max_new_tokens=4, return_logprob=False).output_ids
    assert first[3] not in first[:3]
    out: dict[str, Any] = {}
    for case in CASES:
        short = h.submit([5, 6, 7, 8, 9] * 3, 16, return_logprob=False, stop_token_ids=[first[3]])
        long = h.submit([11, 12, 13] * 4, max_new_tokens=9, return_logprob=False)
        req = sched.reqs_by_rid[short]
        while not (sched.in_flight and len(req.output_ids) == 3):  # (its 4th token is in flight)
            assert sched.step() and len(req.output_ids) < 4  # (had it ended, the check would be void)
        if case == "tensor":
            mine = MultiprocessingSerializer.serialize([]) if rank == 0 else b"not a payload"
            sched.update_weights_from_tensor(UpdateWeightsFromTensorReqInput([mine, mine], flush_cache=False))
        elif case == "disk":
            disk = UpdateWeightFromDiskReqInput(model_path="tiny-qwen3-next", flush_cache=False)
            done = (disk, sched.model_runner.model, None) if rank == 0 else (disk, None, "disk full")
            sched.weight_update.poll = lambda done=done: done
            sched.finish_weight_update()
        else:
            received = UpdateWeightsFromDistributedReqInput(names=[], dtypes=[], shapes=[], flush_cache=False)
            done = (received, [], "") if rank == 0 else (received, None, "the trainer is gone")
            sched.weights_groups.poll = lambda ended_everywhere=None, done=done: done
            sched.finish_weights_group_op()
        replies = [getattr(m, "message", None) for m in sched.tokenizer_outbox]
        sched.tokenizer_outbox.clear()
        sched.run_until_idle()
        h.collect()
        out[case] = {
            "replies": replies,
            "outputs": [h.outputs[r].output_ids for r in (short, long)],
            "digest": list(sched.rank_digest()),
        }
    sched.shutdown()
    return out
