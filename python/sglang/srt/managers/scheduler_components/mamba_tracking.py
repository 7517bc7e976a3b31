"""Where the extra-buffer strategies snapshot recurrent state, and who owns each track slot when.

An extend snapshots only on its lattice, P + k * C for an extend starting at P (C the cache chunk): there
the kernel has an intermediate state. P is a checkpoint, a chunk boundary or 0, so it is a multiple of C
unless the request's hit is a finished request's final state (`MambaRadixCache.cache_finished_req`),
which sits at that request's last position; chunks of the same prompt keep its lattice. Decode snapshots
sit at multiples of the track interval I (a multiple of the page size, not necessarily of C: a hit on one
starts an extend off the lattice, as a finished request's final state does).

Prefill (scheduled and committed at once, when the batch is prepared): the primary snapshot goes to
the last lattice position inside the extend, into entry `mamba_next_track_idx` (with two entries it swaps
right away, so the keep entry is the one just scheduled). Extra snapshots, each into a slot borrowed
for it (skipped if none can be had), go to the branching point B when the extend covers it (B stays
pending through earlier chunks) and, when the extend completes the prompt, to the last lattice position
before its last token: an exact repeat of the prompt must recompute its last token and can hit only
there. The scheduler hands all of them to the tree right after the batch is prepared
(`cache_unfinished_req`), so a request with the same prefix hits while this one still decodes.
Committing before the forward ran is safe: anything that reads the slots runs later on the same stream.

Decode (scheduled when prepared, committed when its result is processed): a boundary step writes into
the next entry; on commit `mamba_last_track_seqlen` advances and (two entries) the index swaps. Until
then the keep entry still holds the previous snapshot, so a request released meanwhile inserts that.

extra_buffer_lazy keeps one track slot resident. At a boundary the second entry borrows a slot (first
try; if the pool is dry, evict one checkpoint and retry) and the snapshot goes there; on commit the
older entry is returned (`donate_mamba_ping_pong_slot`) and the new one becomes `mamba_next_track_idx`.
When no second slot can be had the snapshot overwrites the only slot: the request may then not insert
it (`mamba_lazy_is_insert = False`) until a later boundary gets its second slot.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from sglang.srt.environ import envs
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.common import alloc_mamba_slot
from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


class MambaTracker:
    def __init__(self, pool: HybridReqToTokenPool, tree: BasePrefixCache, track_interval: int):
        self.pool = pool
        self.tree = tree
        strategy = pool.strategy
        self.enabled = strategy.extra_buffer
        self.lazy = strategy.lazy
        self.chunk = strategy.cache_chunk_size
        self.interval = track_interval
        self.lazy_alloc_failures = {"first_try": 0, "retry": 0}

    # ---- prefill -------------------------------------------------------------------------------

    def prefill_track(self, req: Req, prefix_len: int, end: int) -> list[tuple[int, int]]:
        """(slot, position) of each snapshot this extend writes, shallowest first; the last one is the
        primary (the keep entry of the track buffer, committed on the request), the others sit in
        borrowed slots listed in `req.mamba_extra_snapshots`."""
        if not self.enabled:
            return []
        c = self.chunk

        def on_lattice(pos: int) -> int:  # the last snapshot position <= pos this extend can write
            return prefix_len + (pos - prefix_len) // c * c

        primary = on_lattice(end)
        if primary <= prefix_len:
            return []
        extra = set()
        branch = req.mamba_branching_seqlen
        if branch is not None and branch <= end:
            req.mamba_branching_seqlen = None
            extra.add(branch)
        if end == len(req.fill_ids):
            extra.add(on_lattice(end - 1))
        out = []
        assert all((p - prefix_len) % c == 0 for p in extra), (
            f"{req}: snapshot {extra} off the lattice of {prefix_len}"
        )
        for pos in sorted(p for p in extra if prefix_len < p < primary):
            slot, _ = alloc_mamba_slot(self.tree, self.pool.mamba_allocator)
            if slot is None:
                continue
            self.pool.add_extra_snapshot(req, slot, pos)
            out.append((slot, pos))
        entry = req.mamba_next_track_idx
        slot = req.mamba_ping_pong_track_buffer[entry]
        assert slot != -1
        self.pool.advance_track_entry(req, entry)
        req.mamba_last_track_seqlen = primary
        out.append((slot, primary))
        return out

    # ---- decode --------------------------------------------------------------------------------

    def is_boundary(self, seq_len: int) -> bool:
        return self.enabled and seq_len % self.interval == 0

    def boundary_rows(self, seq_lens: list[int]) -> list[int]:
        """The rows of a decode batch (by their seq_len after the step) that end on a track boundary:
        `is_boundary` over the whole batch in one pass, as every decode step asks it of every request."""
        if not self.enabled:
            return []
        interval = self.interval
        return [i for i, n in enumerate(seq_lens) if n % interval == 0]

    def decode_track(self, req: Req, seq_len: int) -> tuple[int, int] | None:
        """(track slot, entry) for a decode step whose state after `seq_len` tokens is a snapshot."""
        if not self.is_boundary(seq_len):
            return None
        entry = self.mamba_lazy_prealloc_at_boundary(req) if self.lazy else req.mamba_next_track_idx
        return req.mamba_ping_pong_track_buffer[entry], entry

    def mamba_lazy_prealloc_at_boundary(self, req: Req) -> int:
        """The entry this boundary writes: the other entry with a borrowed slot, or (no slot to be had)
        the resident one, which makes the request's newest snapshot unsafe to insert for now."""
        pool = self.pool
        other = pool.get_mamba_ping_pong_other_idx(req.mamba_next_track_idx)
        if req.mamba_ping_pong_track_buffer[other] != -1:
            return other
        slot, failed = alloc_mamba_slot(
            self.tree, pool.mamba_allocator, failing_tries=envs.SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL.get()
        )
        self.lazy_alloc_failures["first_try"] += failed >= 1
        self.lazy_alloc_failures["retry"] += failed >= 2
        if slot is None:
            req.mamba_lazy_is_insert = False
            return req.mamba_next_track_idx
        pool.set_mamba_ping_pong_slot(req, other, slot)
        return other

    def commit_decode_track(self, req: Req, entry: int, seq_len: int) -> None:
        """`_mamba_check_track_boundary` on the processed result: the snapshot of `entry` is now the
        request's newest; lazy mode then gives the older slot back (`mamba_lazy_post_decode_at_boundary`)."""
        req.mamba_last_track_seqlen = seq_len
        if self.lazy:
            self.mamba_lazy_post_decode_at_boundary(req, entry)
        else:
            self.pool.advance_track_entry(req, entry)

    def mamba_lazy_post_decode_at_boundary(self, req: Req, entry: int) -> None:
        if entry == req.mamba_next_track_idx:
            return  # written into the only slot: stays non-insertable until a boundary gets its second slot
        self.pool.donate_mamba_ping_pong_slot(req, req.mamba_next_track_idx)
        self.pool.advance_track_entry(req, entry)
        req.mamba_lazy_is_insert = True
