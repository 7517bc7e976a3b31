"""`WeightsUpdateGroups`: upstream's weight-update process groups on the scheduler's side.

/init_weights_update_group joins a torch.distributed group with a trainer (`init_custom_process_group`:
the trainer is rank 0); /update_weights_from_distributed then receives one broadcast tensor per weight
name over it, and the scheduler writes them into the weights in place between two steps
(`Scheduler.finish_weights_group_op`); /destroy_weights_update_group leaves it. Joining and receiving
wait for the trainer to take part, so each runs on a thread of its own while the loop goes on (its
heartbeats keep the watchdog quiet); the loop polls for the end. One such operation at a time.

Under --tp-size N, as upstream, every TP rank joins the group, as rank `rank_offset + tp_rank` (the
trainer's group has world size 1 + N), receives every broadcast tensor whole and writes its own shard of
it; an operation ends on all ranks in the same loop iteration, once it has ended on every rank (`poll`'s
`ended_everywhere`), and the ranks agree on its outcome (the scheduler's `_agree`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sglang.srt.managers.io_struct import InitWeightsUpdateGroupReqInput, UpdateWeightsFromDistributedReqInput
from sglang.srt.managers.scheduler_components.weight_update import in_background
from sglang.srt.utils.custom_process_group import DEFAULT_TIMEOUT, init_custom_process_group

logger = logging.getLogger(__name__)


class WeightsUpdateGroups:
    def __init__(self, device: str, timeout: timedelta = DEFAULT_TIMEOUT):
        self.device = torch.device(device)
        self.timeout = timeout  # how long a join or a broadcast waits for the trainer
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.pending: tuple[Any, Future] | None = None

    def start_init(
        self, req: InitWeightsUpdateGroupReqInput, tp_rank: int = 0, tp_size: int = 1, dp_size: int = 1
    ) -> str | None:
        """Start joining the group as rank `rank_offset + tp_rank`; None, or why it cannot start. The
        layout checks read only the request and the flags, so every rank refuses alike (a rank refusing
        alone would leave the others in the trainer's group, or in the vote, waiting)."""
        busy = self._busy()
        if busy is not None:
            return busy
        if dp_size > 1:  # (upstream refuses it too, unless DP attention is on, which this server lacks)
            return (
                "A weight-update group needs --dp-size 1: every replica's TP ranks would join it under "
                "the same ranks."
            )
        if req.rank_offset + tp_size > req.world_size:
            return (
                f"world_size {req.world_size} is too small: the server's {tp_size} TP rank(s) join as ranks "
                f"rank_offset ({req.rank_offset}) to {req.rank_offset + tp_size - 1}, so world_size must be "
                f"at least rank_offset + --tp-size ({req.rank_offset + tp_size})."
            )
        if req.group_name in self.groups:
            return f"The weight-update group {req.group_name!r} exists already (destroy it first)."
        if req.backend == "nccl" and self.device.type != "cuda":
            return "backend nccl needs the server on a GPU: a server on a CPU joins with backend gloo."
        url = f"tcp://{req.master_address}:{req.master_port}"
        rank = req.rank_offset + tp_rank
        logger.info("Joining weight-update group %r at %s as rank %d of %d.", req.group_name, url,
                    rank, req.world_size)  # fmt: skip

        def join() -> None:
            self.groups[req.group_name] = init_custom_process_group(
                req.backend, url, self.timeout, req.world_size, rank, group_name=req.group_name
            )

        self._run(req, join)
        return None

    def start_receive(self, req: UpdateWeightsFromDistributedReqInput) -> str | None:
        """Start receiving the broadcast tensors; None, or why it cannot start (then nothing takes part
        in the trainer's broadcast)."""
        busy = self._busy()
        if busy is not None:
            return busy
        group = self.groups.get(req.group_name)
        if group is None:
            return f"There is no weight-update group {req.group_name!r}: /init_weights_update_group first."
        # (torch dtypes or their names, "torch." or not: upstream's clients send each)
        dtypes = [getattr(torch, str(d).removeprefix("torch."), None) for d in req.dtypes]
        if not all(isinstance(d, torch.dtype) for d in dtypes):
            return f"dtypes must name torch dtypes; got {req.dtypes!r}."

        def receive() -> list[tuple[str, torch.Tensor]]:
            named = []
            for name, dtype, shape in zip(req.names, dtypes, req.shapes, strict=True):
                tensor = torch.empty(shape, dtype=dtype, device=self.device)
                dist.broadcast(tensor, src=0, group=group)  # in the trainer's order
                named.append((name, tensor))
            if self.device.type == "cuda":
                # NCCL only queues the broadcasts: wait for them here, not in the scheduler's loop.
                torch.cuda.current_stream(self.device).synchronize()
            return named

        self._run(req, receive)
        return None

    def destroy(self, group_name: str) -> str | None:
        """Leave the group; None, or why not."""
        if self.pending is not None and getattr(self.pending[0], "group_name", None) == group_name:
            return f"The weight-update group {group_name!r} is in use: its operation has not ended."
        group = self.groups.pop(group_name, None)
        if group is None:
            return f"There is no weight-update group {group_name!r}."
        dist.destroy_process_group(group)
        return None

    def poll(self, ended_everywhere: Callable[[bool], bool] | None = None) -> tuple[Any, Any, str] | None:
        """(the request, what it gave, why it failed or "") once the operation has ended; None before.
        Under TP `ended_everywhere` (a collective every rank calls alike) says whether it has ended on
        every rank."""
        if self.pending is None:
            return None
        ended = self.pending[1].done()
        if not (ended if ended_everywhere is None else ended_everywhere(ended)):
            return None
        req, future = self.pending
        self.pending = None
        try:
            return req, future.result(), ""
        except Exception as e:  # noqa: BLE001 - the trainer's side or the network: told to the client
            reason = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
            logger.warning("A weight-update group operation failed: %s.", reason)
            return req, None, reason

    def _busy(self) -> str | None:
        if self.pending is None:
            return None
        kind = type(self.pending[0]).__name__
        return f"A weight-update group operation ({kind}) still waits for the trainer."

    def _run(self, req: Any, work: Callable[[], Any]) -> None:
        self.pending = (req, in_background(work, "weights-update-group"))
