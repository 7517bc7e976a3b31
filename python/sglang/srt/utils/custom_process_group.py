"""`init_custom_process_group`, at upstream's name (`sglang.srt.utils`): a torch.distributed process
group of its own, beside the default one or without it, for sending weights from a trainer to servers
(/init_weights_update_group). Both sides build it the same way (a rendezvous at `init_method`, keys
under the group's name), so a trainer using upstream's helper meets a server using this one."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

DEFAULT_TIMEOUT = timedelta(minutes=30)  # torch's default for a process group


def init_custom_process_group(
    backend: str | None = None,
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    store: Any = None,
    group_name: str = "",
    pg_options: Any = None,
    device_id: Any = None,
) -> dist.ProcessGroup:
    """Join the group `group_name` of `world_size` processes as `rank`; blocks until all have joined (or
    `timeout` passes). Ranks within it are its own (0 .. world_size - 1)."""
    timeout = timeout or DEFAULT_TIMEOUT
    if store is None:
        store, rank, world_size = next(c10d.rendezvous(init_method, rank, world_size, timeout=timeout))
        store.set_timeout(timeout)
        store = c10d.PrefixStore(group_name, store)  # another system's keys in the same store stay apart
    pg, _ = c10d._new_process_group_helper(
        world_size,
        rank,
        [],
        dist.Backend(backend or "undefined"),
        store,
        group_name=group_name,
        backend_options=pg_options,
        timeout=timeout,
        device_id=device_id,
    )
    c10d._world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg
