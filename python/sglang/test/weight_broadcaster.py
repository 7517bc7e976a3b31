"""`Broadcaster`: a trainer for tests of /update_weights_from_distributed, in a process of its own: rank 0
of a gloo weight-update group (`init_custom_process_group`, as a trainer calls it), broadcasting the
tensors it is handed, one by one in order, as upstream's trainers do."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import torch


def _trainer_main(url: str, world_size: int, group_name: str, inbox: Any, outbox: Any) -> None:
    import torch.distributed as dist

    from sglang.srt.utils import init_custom_process_group

    try:
        group = init_custom_process_group("gloo", url, world_size=world_size, rank=0, group_name=group_name)
    except Exception as e:  # noqa: BLE001 - told to the test
        outbox.put(f"error: {e}")
        return
    outbox.put("joined")
    while True:
        msg = inbox.get()
        if msg is None:
            dist.destroy_process_group(group)
            return
        for _, tensor in msg:
            dist.broadcast(tensor, src=0, group=group)
        outbox.put("sent")


class Broadcaster:
    def __init__(self, port: int, world_size: int = 2, group_name: str = "weight_update_group"):
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox = ctx.Queue(), ctx.Queue()
        url = f"tcp://127.0.0.1:{port}"
        self.proc = ctx.Process(
            target=_trainer_main, args=(url, world_size, group_name, self.inbox, self.outbox), daemon=True
        )
        self.proc.start()

    def broadcast(self, named: list[tuple[str, torch.Tensor]]) -> None:
        """Start broadcasting `named` (returns at once; `wait` for "sent")."""
        self.inbox.put([(n, t.contiguous()) for n, t in named])

    def wait(self, timeout: float = 60) -> str:
        """The trainer's next word: "joined", "sent" or "error: ..."."""
        return self.outbox.get(timeout=timeout)

    def close(self) -> None:
        if self.proc.is_alive():
            self.inbox.put(None)
            self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()
