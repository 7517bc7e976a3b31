"""Tensor / expert parallel state, at upstream's names (`sglang.srt.distributed`). Before
`initialize_model_parallel` every query answers for one rank and every collective is the identity, so
single-process code paths need no branch."""

from sglang.srt.distributed.parallel_state import (
    GroupCoordinator,
    destroy_model_parallel,
    get_ep_group,
    get_moe_expert_parallel_rank,
    get_moe_expert_parallel_world_size,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    init_distributed_environment,
    initialize_model_parallel,
    model_parallel_is_initialized,
    tensor_model_parallel_all_gather,
    tensor_model_parallel_all_reduce,
)

__all__ = [
    "GroupCoordinator",
    "destroy_model_parallel",
    "get_ep_group",
    "get_moe_expert_parallel_rank",
    "get_moe_expert_parallel_world_size",
    "get_tensor_model_parallel_rank",
    "get_tensor_model_parallel_world_size",
    "get_tp_group",
    "init_distributed_environment",
    "initialize_model_parallel",
    "model_parallel_is_initialized",
    "tensor_model_parallel_all_gather",
    "tensor_model_parallel_all_reduce",
]
