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

extra_buffer_lazy keeps no track slot: a running request holds its running slot only. Every snapshot
goes into a slot borrowed for it (first try; if the pool is dry, evict one checkpoint and retry; if that
fails too the snapshot is skipped and the request runs on) and is handed to the tree: the prefill ones
with the extra snapshots above (all of them are "extra" here), a decode one when its result is processed
(`commit_decode_track`, after which the request protects its KV up to there through the tree). A decode
snapshot that was scheduled but whose result finds the request released (finished in flight, aborted,
retracted) was freed with the request's slots; one a speculative verify did not reach stays borrowed
and is written by the step that reaches its position.
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
        borrowed slots listed in `req.mamba_extra_snapshots` (under lazy all of them do)."""
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
        borrowed = sorted(p for p in extra if prefix_len < p < primary)
        if self.lazy:
            borrowed.append(primary)  # no track buffer: the primary is borrowed too
        for pos in borrowed:
            slot, _ = alloc_mamba_slot(self.tree, self.pool.mamba_allocator)
            if slot is None:
                continue
            self.pool.add_extra_snapshot(req, slot, pos)
            out.append((slot, pos))
        if self.lazy:
            return out
        entry = req.mamba_next_track_idx
        slot = req.mamba_ping_pong_track_buffer[entry]
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
        """(slot, entry) for a decode step whose state after `seq_len` tokens is a snapshot: the track
        entry it writes, or under lazy a borrowed slot (entry -1); None: no snapshot this step (lazy:
        no slot could be had, or fault injection said so)."""
        if not self.is_boundary(seq_len):
            return None
        if not self.lazy:
            entry = req.mamba_next_track_idx
            return req.mamba_ping_pong_track_buffer[entry], entry
        pool = self.pool
        slot = pool.extra_snapshot_at(req, seq_len)  # a verify that did not reach it borrowed it
        if slot is not None:
            return slot, -1
        slot, failed = alloc_mamba_slot(
            self.tree, pool.mamba_allocator, failing_tries=envs.SGLANG_TEST_MAMBA_LAZY_ALLOC_FAIL.get()
        )
        self.lazy_alloc_failures["first_try"] += failed >= 1
        self.lazy_alloc_failures["retry"] += failed >= 2
        if slot is None:
            return None
        pool.add_extra_snapshot(req, slot, seq_len)
        if envs.SGLANG_TEST_SKIP_LAZY_SNAPSHOT_WRITE.get():
            return 0, -1  # (negative control: the step writes the dummy slot, the tree gets `slot` as it is)
        return slot, -1

    def commit_decode_track(self, req: Req, entry: int, seq_len: int) -> None:
        """`_mamba_check_track_boundary` on the processed result: the snapshot the step wrote is now
        the request's newest (in its track entry), or under lazy goes to the tree. Nothing to do for a
        request released since the step was scheduled (its slots went back with it)."""
        if self.lazy:
            slot = self.pool.pop_extra_snapshot(req, seq_len)
            if slot is not None:
                self.tree.cache_snapshot(req, seq_len, slot)
        elif req.mamba_ping_pong_track_buffer is not None:
            req.mamba_last_track_seqlen = seq_len
            self.pool.advance_track_entry(req, entry)
