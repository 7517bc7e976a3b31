"""Per-process setup shared by the server's processes."""

from __future__ import annotations

import gc
import logging
import os

import torch

from sglang.srt.utils.gc_watch import watch_gc

LOG_FORMAT = "[%(asctime)s %(name)s] %(levelname)s %(message)s"


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def default_torch_threads() -> int:
    """Torch threads for a compute process on CPU: one core is left to the scheduler and HTTP threads,
    since oversubscribed cores make torch's parallel regions far slower than one thread."""
    return max(1, available_cores() - 1)


def configure_logging(log_level: str, prefix: str = "") -> None:
    fmt = LOG_FORMAT if not prefix else f"[%(asctime)s {prefix}] %(levelname)s %(message)s"
    logging.basicConfig(level=getattr(logging, log_level.upper()), format=fmt, force=True)


def apply_gc_threshold(server_args) -> None:
    """--gc-threshold: the process's `gc.set_threshold` (None: Python's); --gc-warning-threshold-secs."""
    if server_args.gc_threshold:
        gc.set_threshold(*server_args.gc_threshold)
    watch_gc(server_args.gc_warning_threshold_secs)


def configure_subprocess(server_args, name: str) -> None:
    configure_logging(server_args.log_level, name)
    from sglang.srt.utils.triton_first_use import install_if_asked

    install_if_asked()  # (SGLANG_LOG_TRITON_FIRST_USE)
    apply_gc_threshold(server_args)
    if server_args.device == "cpu":
        threads = default_torch_threads()
        torch.set_num_threads(threads)
        if name == "scheduler" and available_cores() > 1:  # the process that runs the forward
            logging.getLogger(__name__).info(
                "The forward uses %d torch thread(s) of the %d core(s) available (one is left to the scheduler, "
                "tokenizer and detokenizer).",
                threads,
                available_cores(),
            )
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
