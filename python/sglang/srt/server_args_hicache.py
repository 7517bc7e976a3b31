"""The hierarchical cache's flags (upstream's names and defaults; docs/state_management.md, 'Host tier'):
their command-line definitions and the startup checks, each refusal one sentence naming the flag."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang.srt.server_args_checks import ServerArgsError

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

HICACHE_WRITE_POLICIES = ["write_through", "write_back", "write_through_selective"]
# Upstream's I/O backends (its copy kernels or plain copies): accepted, no effect here; every copy goes
# through `HiCacheController` (plain copies on CPU, a copy stream of its own on CUDA).
HICACHE_IO_BACKENDS = ["kernel", "direct"]
# Upstream's storage backends (a third tier beyond host memory); only file is built here.
HICACHE_STORAGE_BACKENDS = ["file", "mooncake", "hf3fs", "nixl", "aibrix", "dynamic", "eic"]


@dataclass
class HiCacheArgs:
    """ServerArgs' hierarchical-cache fields (a base class, so `server_args.py` stays small)."""

    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0  # GB; 0: --hicache-ratio decides
    hicache_write_policy: str = "write_through"
    hicache_io_backend: str = "kernel"
    hicache_storage_backend: str | None = None


def add_hicache_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group(
        "hierarchical cache", "A host-memory tier for KV pages and state snapshots: docs/state_management.md."
    )
    g.add_argument(
        "--enable-hierarchical-cache",
        "--enable-hicache",
        dest="enable_hierarchical_cache",
        action="store_true",
        help="Back the radix cache's KV and checkpoints up to host memory and load them back on a hit.",
    )
    g.add_argument(
        "--hicache-ratio",
        type=float,
        default=2.0,
        help="Host tier size as a multiple of the device pools (KV tokens and state slots); at least 1.",
    )
    g.add_argument(
        "--hicache-size",
        type=int,
        default=0,
        help="Host tier size in GB (KV and states split as on the device); overrides --hicache-ratio if > 0.",
    )
    g.add_argument(
        "--hicache-write-policy", default="write_through", metavar="|".join(HICACHE_WRITE_POLICIES)
    )
    g.add_argument(
        "--hicache-io-backend",
        default="kernel",
        metavar="|".join(HICACHE_IO_BACKENDS),
        help="Accepted as upstream's; no effect (on CUDA every copy runs on a copy stream of the host tier's "
        "own, on CPU on the forward thread).",
    )
    g.add_argument(
        "--hicache-storage-backend",
        default=None,
        metavar="|".join(HICACHE_STORAGE_BACKENDS),
        help="file: a third tier on disk under $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR (default /tmp/hicache); "
        "the others are refused.",
    )


def check_hicache_flags(args: ServerArgs) -> None:
    """After the radix cache and PD settings are resolved (a decode server may have turned the cache off)."""
    if args.hicache_write_policy not in HICACHE_WRITE_POLICIES:
        raise ServerArgsError(
            f"--hicache-write-policy must be one of {', '.join(HICACHE_WRITE_POLICIES)}, "
            f"got {args.hicache_write_policy}."
        )
    if args.hicache_io_backend not in HICACHE_IO_BACKENDS:
        raise ServerArgsError(
            f"--hicache-io-backend must be one of {', '.join(HICACHE_IO_BACKENDS)}, got {args.hicache_io_backend}."
        )
    if args.hicache_storage_backend not in (None, "file"):
        raise ServerArgsError(
            f"--hicache-storage-backend {args.hicache_storage_backend} is not supported by this server: only "
            "file (a disk tier under $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR) is built; use it or leave it out."
        )
    if args.hicache_storage_backend is not None and not args.enable_hierarchical_cache:
        raise ServerArgsError("--hicache-storage-backend needs --enable-hierarchical-cache.")
    if args.hicache_size < 0:
        raise ServerArgsError(
            f"--hicache-size must be 0 (use --hicache-ratio) or more, got {args.hicache_size}."
        )
    if args.hicache_size == 0 and not args.hicache_ratio >= 1:
        raise ServerArgsError(
            f"--hicache-ratio must be at least 1 (the host tier holds at least what the device does), "
            f"got {args.hicache_ratio:g}."
        )
    if not args.enable_hierarchical_cache:
        return
    if args.disable_radix_cache:
        raise ServerArgsError(
            "--enable-hierarchical-cache needs the radix cache: leave out --disable-radix-cache (a decode "
            "server of --disaggregation-mode decode also needs --disaggregation-decode-enable-radix-cache)."
        )
    if args.dp_size > 1:
        raise ServerArgsError(
            "--enable-hierarchical-cache is not supported with --dp-size above 1 yet; leave one out."
        )
