"""The prefix-cache contract the scheduler programs against, with typed results.

Safety rules:
- KV indices and the checkpoint slot of a match are only safe to use while the matched node is locked
  (`inc_lock_ref`). `match_prefix(..., req=req)` locks it for the request (`req.last_node`) before it
  returns, so the eviction that admission runs to make room cannot free it; a request that matched but
  is not admitted releases what the match gave it, lock included (`release_match`).
- A request holds at most one lock, on `req.last_node`, taken on a node that carries a checkpoint (or the
  root). It always protects the KV up to there; a match's lock also pins the checkpoint, while the lock
  an `extra_buffer_lazy` request holds on its newest snapshot does not (`MambaRadixCache.pins_checkpoint`).
- Every slot or page handed to the cache belongs to it afterwards; the cache frees what it does not keep.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req


@dataclass
class MatchResult:
    """`device_indices`: KV slots of the matched prefix, up to the deepest checkpoint. `last_device_node`:
    the node holding that checkpoint (the root if none). `mamba_branching_seqlen`: the chunk-aligned end
    of a deeper KV match without a checkpoint, where the next prefill should take a snapshot."""

    device_indices: list[int]
    last_device_node: Any
    mamba_branching_seqlen: int | None = None
    kv_match_len: int = 0


@dataclass
class InsertResult:
    """`prefix_len`: how much of the key the tree held already. `last_node`: the node ending at the key
    (None for an empty key). `tree_indices`: the tree's KV at positions [prev_prefix_len, prefix_len),
    which replace the caller's duplicates there (freed by the insert)."""

    prefix_len: int
    mamba_exist: bool
    last_node: Any = None
    tree_indices: list[int] = field(default_factory=list)


@dataclass
class EvictResult:
    num_tokens_evicted: int = 0
    num_mamba_evicted: int = 0


class BasePrefixCache(ABC):
    page_size: int

    @abstractmethod
    def match_prefix(
        self, key: list[int], cow_mamba: bool = False, req: Req | None = None, namespace: str | None = None
    ) -> MatchResult:
        """Longest usable cached prefix of `key`. With `req`, the matched node is locked for it
        (`req.last_node`). With `cow_mamba` and a checkpoint hit, `req` gets a running slot (allocated
        here, evicting a checkpoint if needed) and `mamba_cow_src_index`; the copy itself is deferred
        to the forward stream. The match is among the sequences of `req.extra_key`'s prefix-cache
        namespace (without `req`: of `namespace`)."""

    @abstractmethod
    def cache_finished_req(self, req: Req, is_insert: bool = True) -> None:
        """Insert what a finished request can give the tree, free everything else it holds, unlock."""

    @abstractmethod
    def cache_unfinished_req(self, req: Req, chunked: bool = False) -> None:
        """Insert the prefix of a request that continues (chunked prefill); it keeps running."""

    def cache_snapshot(self, req: Req, pos: int, slot: int) -> None:
        """Insert a continuing request's prefix up to `pos` with the recurrent-state snapshot in `slot` (a
        borrowed slot the tree takes over); only a tree that caches recurrent state is asked."""
        raise NotImplementedError(f"{type(self).__name__} caches no recurrent-state snapshots.")

    @abstractmethod
    def release_match(self, req: Req) -> None:
        """Undo what `match_prefix` gave a request that is not admitted (lock, COW slot, flags)."""

    @abstractmethod
    def evict(self, num_tokens: int = 0, mamba_num: int = 0) -> EvictResult: ...

    @abstractmethod
    def inc_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def dec_lock_ref(self, node: Any) -> None: ...

    @abstractmethod
    def reset(self) -> None: ...

    def take_host_copies(self) -> list | None:
        """Once per batch, at its preparation (a speculative verify's: once its KV is allocated, before
        its draft steps run): the copies between the device and a host tier it must run on the forward
        stream first (`run_host_copies`, a pre-forward op: `forward_worker.pre_forward_ops`); None for a
        tree without one."""
        return None

    def run_host_copies(self, copies: list) -> None:
        """On the forward stream: the copies `take_host_copies` sealed (a tree without a host tier has
        none)."""
        return None

    def weights_changed(self) -> None:
        """The model's weights were updated in place (a disk tier stops serving entries of the old ones)."""
        return None

    def keep_off_host(self, namespace: str) -> None:
        """The host and disk tiers neither back up nor load sequences of this prefix-cache namespace (the
        server's warm-up's, until the next reset); a tree without them has nothing to do."""
        return None

    def supports_mamba(self) -> bool:
        return True

    def defers_finished_release(self, req: Req) -> bool:
        """Whether a finished `req` that a batch in flight still contains should be released only once
        that batch is processed, because the tree would then take its settled final state."""
        return False

    def evictable_size(self) -> int:
        return 0

    def mamba_evictable_size(self) -> int:
        return 0

    def total_size(self) -> int:
        """KV slots the cache owns."""
        return 0

    def mamba_total_size(self) -> int:
        """Mamba slots (checkpoints) the cache owns."""
        return 0

    def held_kv_slots(self) -> list[int]:
        """Every KV slot the cache owns (for the accounting check)."""
        return []

    def held_mamba_slots(self) -> list[int]:
        """Every mamba slot the cache owns (for the accounting check)."""
        return []
