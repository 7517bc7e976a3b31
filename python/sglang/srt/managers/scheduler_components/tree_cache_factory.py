"""The scheduler's prefix cache, by the flags: none (`ChunkCache`), the radix cache, or the radix cache
with a host-memory tier (`--enable-hierarchical-cache`), whose copies run on the forward stream through
the forward worker's before-batch hook."""

from __future__ import annotations

from sglang.srt.environ import envs
from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.chunk_cache import ChunkCache
from sglang.srt.mem_cache.mamba_radix_cache import MambaRadixCache
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
from sglang.srt.server_args import ServerArgs, ServerArgsError


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

    try:
        return HiMambaRadixCache(
            req_to_token_pool,
            token_allocator,
            args.page_size,
            model_runner.token_to_kv_pool,
            write_policy=args.hicache_write_policy,
            ratio=args.hicache_ratio,
            size_gb=args.hicache_size,
            io_backend=args.hicache_io_backend,
            storage=_file_storage(args),
        )
    except HostPoolSizeError as e:
        raise ServerArgsError(str(e)) from None


def _file_storage(args: ServerArgs) -> tuple[str, str] | None:
    """The `file` backend's folder and what its entries must match (model, page size, dtypes)."""
    if args.hicache_storage_backend != "file":
        return None
    fingerprint = "|".join(
        map(str, (args.model_path, args.page_size, args.kv_cache_dtype, args.dtype, args.mamba_ssm_dtype))
    )
    return envs.SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR.get(), fingerprint


def attach_tree_cache(tree_cache: BasePrefixCache, worker) -> None:
    """A host tier's copies run on the forward stream before each batch."""
    before_batch = getattr(tree_cache, "before_batch", None)
    if before_batch is not None:
        worker.before_batch_hooks.append(before_batch)
