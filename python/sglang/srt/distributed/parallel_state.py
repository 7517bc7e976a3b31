"""The process groups of tensor and expert parallelism, one owner for them (upstream's `parallel_state`).

`init_distributed_environment` joins the world (gloo on CPU, NCCL between GPUs, both through
torch.distributed); `initialize_model_parallel` forms the TP group (every rank of this server: one TP group,
as upstream with pipeline parallelism off) and the EP group (`ep_size` ranks inside it). Each group has a
device group for tensors and a gloo group on the CPU for Python objects (the scheduler's broadcast of new
requests), so that object traffic never waits behind the device's stream.

Before `initialize_model_parallel` the groups answer for one rank: world size 1, rank 0, every collective
the identity. Single-process code calls the same functions with no branch."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class GroupCoordinator:
    """One parallel group: its ranks (global), this process's rank in it, and its two process groups.
    `device_group` is None for a group of one (no collective ever runs on it)."""

    ranks: list[int]
    rank_in_group: int
    device_group: Any = None
    cpu_group: Any = None

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    @property
    def is_first_rank(self) -> bool:
        return self.rank_in_group == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the group, in place where the backend allows (returns the summed tensor)."""
        if self.world_size == 1:
            return x
        dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.world_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """`x` from the group's rank `src` (in place on the others)."""
        if self.world_size > 1:
            dist.broadcast(x, src=self.ranks[src], group=self.device_group)
        return x

    def broadcast_object(self, obj: Any = None, src: int = 0) -> Any:
        """A picklable object from the group's rank `src` to every rank, over the CPU group."""
        if self.world_size == 1:
            return obj
        box = [obj if self.rank_in_group == src else None]
        dist.broadcast_object_list(box, src=self.ranks[src], group=self.cpu_group)
        return box[0]

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.cpu_group)


def gather_objects(value: Any, group: Any, world_size: int) -> list[Any]:
    """Every rank's `value` (a small picklable host value: a flag, a count, a few messages), in rank
    order, on every rank, over the gloo group `group` of `world_size` ranks; `[value]` at one rank (no
    collective). The one way the scheduler, the pool planner and the PD queues gather host values."""
    if world_size == 1:
        return [value]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, value, group=group)
    return out


_SINGLE = GroupCoordinator(ranks=[0], rank_in_group=0)
_TP: GroupCoordinator | None = None
_EP: GroupCoordinator | None = None


def init_distributed_environment(
    backend: str,
    world_size: int,
    rank: int,
    distributed_init_method: str,
    timeout: timedelta | None = None,
) -> None:
    """Join the default process group (blocks until `world_size` processes have joined, or `timeout`)."""
    if dist.is_initialized():
        return
    dist.init_process_group(
        backend=backend,
        init_method=distributed_init_method,
        world_size=world_size,
        rank=rank,
        timeout=timeout or timedelta(minutes=30),
    )


def _new_group(ranks: list[int], backend: str, timeout: timedelta | None) -> GroupCoordinator:
    """Every process must call this with the same `ranks` (torch.distributed's rule for new_group).
    `timeout` bounds each of the group's collectives (None: torch's default, 30 minutes)."""
    device_group = dist.new_group(ranks, backend=backend, timeout=timeout)
    cpu_group = device_group if backend == "gloo" else dist.new_group(ranks, backend="gloo", timeout=timeout)
    me = dist.get_rank()
    return GroupCoordinator(ranks, ranks.index(me) if me in ranks else -1, device_group, cpu_group)


def initialize_model_parallel(
    tensor_model_parallel_size: int = 1,
    expert_model_parallel_size: int = 1,
    timeout: timedelta | None = None,
) -> None:
    """Form the TP group (all ranks) and the EP groups (consecutive blocks of `expert_model_parallel_size`
    ranks inside it), each collective of theirs bounded by `timeout` (--dist-timeout). The default group
    must already exist when either size is above 1."""
    global _TP, _EP
    tp, ep = tensor_model_parallel_size, expert_model_parallel_size
    if tp == 1:
        _TP, _EP = _SINGLE, _SINGLE
        return
    assert dist.is_initialized() and dist.get_world_size() == tp, "init_distributed_environment first"
    assert tp % ep == 0, f"ep_size {ep} must divide tp_size {tp}"
    backend = dist.get_backend()
    _TP = _new_group(list(range(tp)), backend, timeout)
    blocks = range(0, tp, ep) if ep > 1 else []
    groups = [_new_group(list(range(s, s + ep)), backend, timeout) for s in blocks]
    _EP = next((g for g in groups if g.rank_in_group >= 0), _SINGLE)


def model_parallel_is_initialized() -> bool:
    return _TP is not None


def destroy_model_parallel() -> None:
    """Forget the groups and leave the default group (a process that served ends here)."""
    global _TP, _EP
    _TP = _EP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_group() -> GroupCoordinator:
    return _TP or _SINGLE


def tp_gather(value: Any) -> list[Any]:
    """Every TP rank's `value` (a small picklable host value), in rank order, on every rank, over the TP
    group's gloo group; `[value]` at one rank and before `initialize_model_parallel` (or under a stand-in
    group without a gloo group). Every rank calls it at the same point: what the ranks must agree on
    that each measured alone (the pool planner's memory budget, the CUDA graphs' captured sizes)."""
    group = get_tp_group()
    if group.cpu_group is None:
        return [value]
    return gather_objects(value, group.cpu_group, group.world_size)


def get_ep_group() -> GroupCoordinator:
    return _EP or _SINGLE


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def get_moe_expert_parallel_world_size() -> int:
    return get_ep_group().world_size


def get_moe_expert_parallel_rank() -> int:
    return get_ep_group().rank_in_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    return get_tp_group().all_gather(x, dim)
