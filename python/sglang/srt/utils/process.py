"""Per-process setup shared by the server's processes."""

from __future__ import annotations

import logging
import os

import torch

LOG_FORMAT = "[%(asctime)s %(name)s] %(levelname)s %(message)s"


def default_torch_threads() -> int:
    """Torch threads for a compute process on CPU: one core is left to the scheduler and HTTP threads,
    since oversubscribed cores make torch's parallel regions far slower than one thread."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def configure_logging(log_level: str, prefix: str = "") -> None:
    fmt = LOG_FORMAT if not prefix else f"[%(asctime)s {prefix}] %(levelname)s %(message)s"
    logging.basicConfig(level=getattr(logging, log_level.upper()), format=fmt, force=True)


def configure_subprocess(server_args, name: str) -> None:
    configure_logging(server_args.log_level, name)
    if server_args.device == "cpu":
        torch.set_num_threads(default_torch_threads())
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
