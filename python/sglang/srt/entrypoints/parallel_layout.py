"""Which scheduler processes this node starts, and where each sits (docs/parallelism.md).

- `--tp-size T --nnodes N --node-rank n`: T / N ranks on this node, global TP ranks n*T/N .. (n+1)*T/N - 1,
  rank i of the node on its i-th GPU; they meet at --dist-init-addr (else a free local port).
- `--dp-size D` (one node): D replicas of T ranks each, every replica its own process group (port + d of
  --dist-init-addr, else a free port each), behind the data-parallel controller, which takes the
  tokenizer's socket and talks to each replica's rank 0 on its own.
- Neither: one scheduler, as without this module (`rank` None).
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.io_struct import PortArgs
from sglang.srt.managers.scheduler_components.tp_broadcast import DEFAULT_DIST_TIMEOUT_S, ParallelRank
from sglang.srt.server_args_parallel import split_init_addr
from sglang.srt.utils.process import available_cores


@dataclass
class SchedulerSpec:
    name: str
    rank: ParallelRank | None
    port_args: PortArgs


@dataclass
class ControllerSpec:
    """The data-parallel controller's sockets: each replica's input, and where replicas reply."""

    replica_inputs: list[str]
    reply_ipc: str


def plan_schedulers(
    server_args: Any, port_args: PortArgs
) -> tuple[list[SchedulerSpec], ControllerSpec | None]:
    tp, dp = server_args.tp_size, server_args.dp_size
    if tp == 1 and dp == 1:
        return [SchedulerSpec("scheduler", None, port_args)], None
    controller = None
    replica_ports = [port_args]
    if dp > 1:
        controller = ControllerSpec([port_args.ipc_name(f"dp{d}") for d in range(dp)], port_args.ipc_name("dp-replies"))
        replica_ports = [
            dataclasses.replace(
                port_args, scheduler_input_ipc_name=name, tokenizer_ipc_name=controller.reply_ipc
            )
            for name in controller.replica_inputs
        ]
    per_node = server_args.tp_size_per_node
    first = server_args.node_rank * per_node
    # On CPU the node's ranks share its cores (one left to the tokenizer and detokenizer, as with one rank).
    threads = max(1, (available_cores() - 1) // (per_node * dp)) if server_args.device == "cpu" else None
    specs = []
    for d in range(dp):
        init_method = _init_method(server_args.dist_init_addr, d) if tp > 1 else ""
        for local in range(per_node):
            rank = ParallelRank(
                tp_rank=first + local,
                tp_size=tp,
                ep_size=server_args.ep_size,
                dp_rank=d if dp > 1 else None,
                init_method=init_method,
                backend="nccl" if server_args.device == "cuda" else "gloo",
                timeout_s=server_args.dist_timeout or DEFAULT_DIST_TIMEOUT_S,
                gpu_id=d * per_node + local,
                torch_threads=threads,
            )
            specs.append(SchedulerSpec(f"scheduler ({rank.describe()})", rank, replica_ports[d]))
    return specs, controller


def _init_method(dist_init_addr: str | None, offset: int) -> str:
    if dist_init_addr is None:
        return f"tcp://127.0.0.1:{_free_port()}"
    host, port = split_init_addr(dist_init_addr)
    host = f"[{host}]" if ":" in host else host
    return f"tcp://{host}:{port + offset}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

