"""The scheduler's prefix cache, by the flags: none (`ChunkCache`), the radix cache, or the radix cache
with a host-memory tier (`--enable-hierarchical-cache`), whose copies run on the forward stream through
the forward worker's before-batch hook.

Under tensor parallelism every rank builds its own host tier (its shard of the KV and states) and makes
the same decisions from the same trees; what can differ by rank (the host memory available, a disk tier's
files) is agreed over a gloo group of the host tier's own (`TpAgreement`), made here while every rank
builds its tree cache in step: the model's collectives and the scheduler's broadcasts run on other
groups, so an agreement never interleaves with them."""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass
from typing import Any

import torch

from sglang.srt.environ import envs
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.disk_budget import NO_CAP, ranks_sharing
from sglang.srt.mem_cache.disk_tier import DiskTierConfig, DiskTierError, parse_size, safe_dir
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.server_args import ServerArgs, ServerArgsError

logger = logging.getLogger(__name__)


def create_tree_cache(
    args: ServerArgs,
    model_runner,
    req_to_token_pool: HybridReqToTokenPool,
    token_allocator: PagedTokenAllocator,
) -> BasePrefixCache:
    if args.disable_radix_cache:
        return ChunkCache(req_to_token_pool, token_allocator, args.page_size)
    if not args.enable_hierarchical_cache:
        return MambaRadixCache(req_to_token_pool, token_allocator, args.page_size)
    from sglang.srt.mem_cache.hiradix_cache import HiMambaRadixCache
    from sglang.srt.mem_cache.host_pool import HostPoolSizeError

    tp = TpAgreement.create(args)
    storage, cache, error = None, None, None
    try:
        storage = _file_storage(args, model_runner)
    except Exception as e:  # (any failure on one rank: the others must not wait for it; _why)
        error = _why(e)
    _refuse_on_every_rank(tp, error)  # (before the host tier's own agreements: all ranks reach them)
    if storage is not None and tp is not None:  # (ranks on one filesystem split its free space)
        storage.ranks = ranks_sharing(_usable_dir(storage.root), tp.gather)
    try:
        cache = HiMambaRadixCache(
            req_to_token_pool,
            token_allocator,
            args.page_size,
            model_runner.token_to_kv_pool,
            write_policy=args.hicache_write_policy,
            ratio=args.hicache_ratio,
            size_gb=args.hicache_size,
            storage=storage,
            tp=tp,
        )
    except Exception as e:
        error = _why(e, HostPoolSizeError)
    # (a rank whose disk folder is refused: none waits for it. The tier's own agreements, HostPools' sizes,
    # come before whatever in it can fail on one rank alone: allocation, the disk folder's listing.)
    _refuse_on_every_rank(tp, error)
    return cache


def _usable_dir(root: str) -> str | None:
    """`root`, created if needed, or None where it is refused (the host tier then refuses to start)."""
    try:
        safe_dir(root)
    except (DiskTierError, OSError):
        return None
    return root


def _why(e: Exception, *expected: type[Exception]) -> str:
    """A start failure as one sentence: a refusal's own (ServerArgsError, DiskTierError, `expected`), or
    any other exception (an allocation's RuntimeError, an OSError of the disk folder, a bad environment
    variable), named with its type; its traceback goes to the log."""
    if isinstance(e, (ServerArgsError, DiskTierError, *expected)):
        return str(e)
    logger.exception("the host tier failed to start")
    return f"the host tier failed to start: {type(e).__name__}: {e}"


def _refuse_on_every_rank(tp: TpAgreement | None, error: str | None) -> None:
    """ServerArgsError on every rank where any rank has an `error` (this rank's, else the first one's,
    naming its rank)."""
    if tp is not None:
        failed = [(r, e) for r, e in enumerate(tp.gather(error)) if e]
        if failed and error is None:
            error = f"TP rank {failed[0][0]}: {failed[0][1]}"
    if error is not None:
        raise ServerArgsError(error)


@dataclass
class TpAgreement:
    """How the TP ranks' host tiers agree: `gather(value)` is every rank's value, in rank order, on every
    rank; every rank must call it at the same point of its (identical) decisions."""

    group: Any
    world_size: int
    ranks_per_node: int

    @classmethod
    def create(cls, args: ServerArgs) -> TpAgreement | None:
        """None at one rank; else a new gloo group of the TP ranks (every rank calls this in step)."""
        import torch.distributed as dist

        from sglang.srt.distributed import get_tp_group

        if not dist.is_initialized():
            return None
        tp = get_tp_group()
        if tp.world_size == 1:
            return None
        group = dist.new_group(list(tp.ranks), backend="gloo")
        return cls(group, tp.world_size, max(1, args.tp_size // max(1, args.nnodes)))

    def gather(self, value: Any) -> list[Any]:
        from sglang.srt.distributed.parallel_state import gather_objects

        return gather_objects(value, self.group, self.world_size)

    def smallest(self, value: int) -> int:
        return min(self.gather(int(value)))


def _file_storage(args: ServerArgs, model_runner) -> DiskTierConfig | None:
    """The `file` backend's folder, budget and what its entries must match (`disk_fingerprint`), from
    our variables and upstream's (each one that is not valid refused naming it)."""
    if args.hicache_storage_backend != "file":
        return None
    max_bytes, max_from = _asked_budget()
    raw = envs.SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE.get() or "0"  # (empty: no floor, as upstream)
    try:
        floor = parse_size(raw)
    except ValueError:
        raise ServerArgsError(
            f"SGLANG_HICACHE_FILE_BACKEND_MIN_FREE_SPACE must be a size such as 10G, 1Gi or a byte count "
            f"(got {raw!r})."
        ) from None
    ratio = _env(envs.SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO, "a number in (0, 1] such as 0.9")
    if not 0 < ratio <= 1:
        raise ServerArgsError(
            f"SGLANG_HICACHE_FILE_BACKEND_EVICTION_RATIO must be in (0, 1] (got {ratio:g})."
        )
    # Upstream's positive lookup cache: our index is in memory always (a lookup never asks the
    # filesystem; a file deleted by another program is noticed at its read, the hit not taken).
    _env(envs.SGLANG_HICACHE_FILE_BACKEND_ENABLE_METADATA_CACHE, "1/0 or true/false")
    _env(envs.SGLANG_HICACHE_FILE_BACKEND_METADATA_TTL, "a number of seconds (-1: no expiry)")
    root = envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.get()
    return DiskTierConfig(root, disk_fingerprint(args, model_runner), max_bytes, floor, ratio, max_from)


def _env(var, what: str) -> Any:  # noqa: ANN001 - an `environ.EnvVar`
    try:
        return var.get()
    except ValueError:
        raise ServerArgsError(f"{var.name} must be {what} (got {os.environ.get(var.name)!r}).") from None


def _asked_budget() -> tuple[int, str]:
    """(bytes, the variable that set them): upstream's SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE (a size; 0: no
    cap, as upstream) or ours, SGLANG_HICACHE_FILE_BACKEND_MAX_GB; both set is refused."""
    size, gb = envs.SGLANG_HICACHE_FILE_BACKEND_MAX_SIZE, envs.SGLANG_HICACHE_FILE_BACKEND_MAX_GB
    if size.is_set():
        if gb.is_set():
            raise ServerArgsError(f"Set one of {size.name} (upstream's) and {gb.name}, not both.")
        raw = size.get() or "0"  # (empty: no cap, as upstream)
        try:
            n = parse_size(raw)
        except ValueError:
            raise ServerArgsError(
                f"{size.name} must be a size such as 200G, 1Gi or a byte count, or 0 for no cap "
                f"(got {raw!r})."
            ) from None
        return (n or NO_CAP), size.name
    value = _env(gb, "a number of GB")
    if not value > 0:
        raise ServerArgsError(f"{gb.name} must be above 0 (got {value:g}).")
    return int(value * (1 << 30)), gb.name


def weight_files_identity(path: str) -> list[tuple[str, int, int]]:
    """(name, bytes, mtime in ns) of every file of a local checkpoint folder: a changed file (new weights
    written over the old ones) changes the disk tier's folder."""
    if not os.path.isdir(path):
        return []
    out = []
    for name in sorted(os.listdir(path)):
        st = os.stat(os.path.join(path, name))
        if stat.S_ISREG(st.st_mode):
            out.append((name, st.st_size, st.st_mtime_ns))
    return out


def disk_fingerprint(args: ServerArgs, model_runner) -> str:
    """What the disk tier's entries must match: the resolved checkpoint and its files, quantization,
    device type, page size, this rank, and the real dtypes and per-token / per-slot shapes of the pools."""
    path = args.model_config.path
    kv, mp = model_runner.token_to_kv_pool, model_runner.req_to_token_pool.mamba_pool
    layout = [(str(t.dtype), tuple(t.shape[1:])) for t in (*kv.k_buffer, *kv.v_buffer)]
    layout += [(str(t.dtype), (t.shape[0], *t.shape[2:])) for t in (mp.conv_state, mp.ssm_state)]
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    device = torch.device(args.device).type
    files = weight_files_identity(path)
    shard = (rank, args.tp_size)  # (each TP rank's own folder: its shard of the KV heads and states)
    return repr((os.path.abspath(path), files, args.quantization, device, args.page_size, shard, layout))
