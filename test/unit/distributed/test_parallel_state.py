"""`sglang.srt.distributed.parallel_state`: before initialisation every query answers for one rank and
every collective is the identity; with 4 gloo ranks the TP group sums and gathers over all of them, the EP
groups over consecutive pairs, and objects broadcast from rank 0 over the CPU group."""

from __future__ import annotations

import torch

from sglang.srt import distributed as ps
from sglang.test.ci_register import register_cpu_ci
from sglang.test.multi_rank import run_ranks
from sglang.test.multi_rank_workers import parallel_state_probe

register_cpu_ci(est_time=8, suite="per-commit-cpu")


def test_single_rank_defaults_are_identities():
    x = torch.arange(4.0)
    assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_tensor_model_parallel_rank() == 0
    assert ps.get_moe_expert_parallel_world_size() == 1
    assert ps.tensor_model_parallel_all_reduce(x) is x
    assert ps.tensor_model_parallel_all_gather(x) is x
    assert ps.get_tp_group().broadcast_object({"a": 1}) == {"a": 1}


def test_four_gloo_ranks_form_tp_and_ep_groups():
    got = run_ranks(parallel_state_probe, 4)
    for rank, (summed, gathered, ep_ranks, ep_rank, ep_sum, obj) in enumerate(got):
        assert summed == [10.0, 10.0]  # 1 + 2 + 3 + 4
        assert gathered == [0.0, 1.0, 2.0, 3.0]  # rank order
        assert ep_ranks == ([0, 1] if rank < 2 else [2, 3]) and ep_rank == rank % 2
        assert ep_sum == (1.0 if rank < 2 else 5.0)
        assert obj == {"from": 0}
