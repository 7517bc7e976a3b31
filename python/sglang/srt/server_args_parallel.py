"""The parallelism flags (upstream's names and defaults): tensor, expert and data parallelism and more than
one node. Their command line and their checks, each refusal one sentence naming the flag; how the ranks
are started and talk is `entrypoints/process_launcher.py` and docs/parallelism.md."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from sglang.srt.server_args_checks import ServerArgsError, _positive

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

# Upstream's --load-balance-method values (old and new); the data-parallel controller implements these.
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "auto")
UPSTREAM_LOAD_BALANCE_METHODS = ("minimum_tokens", "total_requests", "total_tokens", "follow_bootstrap_room")


def add_parallel_cli_args(parser: argparse.ArgumentParser, default: Any) -> None:
    g = parser.add_argument_group(
        "parallelism", "Tensor, expert and data parallelism on torch.distributed (docs/parallelism.md)."
    )
    g.add_argument(
        "--tp-size",
        "--tp",
        type=int,
        default=default("tp_size"),
        help="Tensor-parallel ranks: one scheduler process per rank, NCCL between GPUs, gloo on CPU.",
    )
    g.add_argument(
        "--ep-size",
        "--ep",
        "--expert-parallel-size",
        dest="ep_size",
        type=int,
        default=default("ep_size"),
        help="Expert-parallel ranks inside the tensor-parallel group (must divide --tp-size).",
    )
    g.add_argument(
        "--dp-size",
        "--data-parallel-size",
        dest="dp_size",
        type=int,
        default=default("dp_size"),
        help="Data-parallel replicas, each of --tp-size ranks, behind the in-process data-parallel controller.",
    )
    g.add_argument(
        "--load-balance-method",
        default=default("load_balance_method"),
        metavar="{" + ",".join(LOAD_BALANCE_METHODS) + "}",
        help="How the data-parallel controller spreads requests: round_robin (auto is round_robin) or "
        "shortest_queue (the replica with the fewest unfinished requests).",
    )
    g.add_argument(
        "--nnodes", type=int, default=default("nnodes"), help="Nodes the tensor-parallel ranks span."
    )
    g.add_argument(
        "--node-rank", type=int, default=default("node_rank"), help="This node's rank (0 serves HTTP)."
    )
    g.add_argument(
        "--dist-init-addr",
        "--nccl-init-addr",
        dest="dist_init_addr",
        default=None,
        metavar="HOST:PORT",
        help="Where the ranks meet (node 0's address and a free port); default a free local port (one node).",
    )
    g.add_argument(
        "--dist-timeout",
        type=int,
        default=None,
        help="Seconds the ranks wait for one another at start (and per collective); default 300 at start.",
    )
    g.add_argument(
        "--enable-dp-attention",
        action="store_true",
        help="Refused: data-parallel attention is not built (use --dp-size for replicas).",
    )


def check_parallel_flags(args: ServerArgs) -> None:
    for flag, value in [
        ("--tp-size", args.tp_size),
        ("--ep-size", args.ep_size),
        ("--dp-size", args.dp_size),
        ("--nnodes", args.nnodes),
    ]:
        _positive(flag, value)
    if args.enable_dp_attention:
        raise ServerArgsError(
            "--enable-dp-attention is not supported by this server: data-parallel attention is not built; "
            "use --dp-size for whole replicas."
        )
    if args.load_balance_method in UPSTREAM_LOAD_BALANCE_METHODS:
        raise ServerArgsError(
            f"--load-balance-method {args.load_balance_method} is not supported by this server; use "
            "round_robin or shortest_queue (or sglang-router's policies in front of --dp-size 1 servers)."
        )
    if args.load_balance_method not in LOAD_BALANCE_METHODS:
        raise ServerArgsError(
            f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}, "
            f"got {args.load_balance_method!r}."
        )
    if args.tp_size % args.ep_size:
        raise ServerArgsError(f"--ep-size {args.ep_size} must divide --tp-size {args.tp_size}.")
    if args.nnodes > 1 and args.dist_init_addr is None:
        raise ServerArgsError(
            f"--nnodes {args.nnodes} needs --dist-init-addr HOST:PORT (node 0's address and a free port), "
            "the same on every node."
        )
    if not 0 <= args.node_rank < args.nnodes:
        raise ServerArgsError(
            f"--node-rank {args.node_rank} must be between 0 and --nnodes - 1 ({args.nnodes - 1})."
        )
    if args.tp_size % args.nnodes:
        raise ServerArgsError(
            f"--tp-size {args.tp_size} must be a multiple of --nnodes {args.nnodes} (each node runs "
            "the same number of ranks)."
        )
    if args.nnodes > 1 and args.dp_size > 1:
        raise ServerArgsError(
            "--dp-size with --nnodes above 1 is not supported by this server; run one --dp-size server "
            "per node behind sglang-router instead."
        )
    if args.dist_init_addr is not None:
        split_init_addr(args.dist_init_addr)
    if args.dist_timeout is not None:
        _positive("--dist-timeout", args.dist_timeout)
    if args.dp_size > 1 and args.disaggregation_mode != "null":
        raise ServerArgsError(
            f"--dp-size {args.dp_size} with --disaggregation-mode {args.disaggregation_mode} is not "
            "supported by this server; run one server per replica behind sglang-router."
        )


def split_init_addr(addr: str) -> tuple[str, int]:
    """(host, port) of --dist-init-addr HOST:PORT ([IPv6]:PORT too)."""
    host, sep, port = addr.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ServerArgsError(f"--dist-init-addr {addr!r} must be HOST:PORT with a port between 1 and 65535.")
    return host, int(port)
