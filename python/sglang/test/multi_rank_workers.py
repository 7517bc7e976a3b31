"""Functions run on each rank by `sglang.test.multi_rank.run_ranks` (importable by name, as spawn needs)."""

from __future__ import annotations

import torch

from sglang.srt import distributed as ps


def parallel_state_probe(rank: int, world_size: int, init_method: str) -> tuple:
    """TP over all ranks and EP over pairs: a sum, a gather, an EP sum and a broadcast object."""
    ps.init_distributed_environment("gloo", world_size, rank, init_method)
    ps.initialize_model_parallel(world_size, 2)
    try:
        tp, ep = ps.get_tp_group(), ps.get_ep_group()
        summed = tp.all_reduce(torch.full((2,), float(rank + 1)))
        gathered = tp.all_gather(torch.tensor([float(rank)]), dim=0)
        ep_sum = ep.all_reduce(torch.tensor([float(rank)]))
        obj = tp.broadcast_object({"from": rank} if rank == 0 else None)
        return summed.tolist(), gathered.tolist(), ep.ranks, ep.rank_in_group, ep_sum.item(), obj
    finally:
        ps.destroy_model_parallel()
