"""`ScheduleBatch`: one forward's worth of requests and what the scheduler decided for each row, turned
into a `ForwardBatch`. `Req` lives in managers/req.py (its KV and Mamba bookkeeping are described there)
and is re-exported here, upstream's import path; a decode batch's per-request rows are
scheduler_components/decode_rows.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from sglang.srt.constrained.vocab_mask import VocabMaskInfo
from sglang.srt.managers.req import Req
from sglang.srt.managers.scheduler_components.decode_rows import (
    DecodeRows,
    DecodeRowsCache,
    hidden_states_mask,
    lora_host_tensors,
    sampling_columns,
    token_ids_logprobs,
)
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, SamplingBatchInfo
from sglang.srt.sampling.custom_logit_processor import CustomLogitInfo
from sglang.srt.sampling.penaltylib import PenaltyBatchInfo, PenaltySlots

if TYPE_CHECKING:
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache

__all__ = ["Req", "ScheduleBatch", "SnapshotTracker", "InflightLedger", "DecodeShortcuts"]


class SnapshotTracker(Protocol):
    """What a batch asks of the scheduler's `MambaTracker` (kept structural so that this module, which
    the tracker reads `Req` from, does not import it back)."""

    def prefill_track(self, req: Req, prefix_len: int, end: int) -> list[tuple[int, int]]: ...

    def decode_track(self, req: Req, seq_len: int) -> tuple[int, int] | None: ...

    def boundary_rows(self, seq_lens: list[int]) -> list[int]: ...


class InflightLedger(Protocol):
    """What a request and a batch ask of the scheduler's `InflightBatches` (structural, as above)."""

    def add(self, batch: ScheduleBatch) -> None: ...

    def steady_decode_input_ids(self, reqs: list[Req]) -> tuple[Sequence[int], bool] | None: ...

    def decode_input_ids(self, reqs: list[Req]) -> tuple[Sequence[int], bool]: ...

    def num_inflight(self, req: Req) -> int: ...

    def inflight_tokens(self, req: Req) -> int: ...


class MixedDecodeRows(Protocol):
    """A mixed batch's decode rows (`scheduler_components/mixed_chunk.MixedDecodeRows`; structural, as
    above): the requests, each one's new KV slot and its KV length after it."""

    reqs: list[Req]
    out_cache_loc: list[int]
    seq_lens: list[int]


class DecodeShortcuts(Protocol):
    """What a decode build asks of the scheduler's `DecodeFastPath` (structural, as above): its rows
    cache, and `flush` before the build reads the requests' lists."""

    rows_cache: DecodeRowsCache

    def flush(self) -> None: ...


class ScheduleBatch:
    """The requests of one forward and what the scheduler decided for each row.

    Built on the scheduler thread from host state only; `forward_batch` is what the forward stream runs.
    `sample_rows[i]` says whether row i's sampled token is a real output (the last prefill chunk of a
    request that wants tokens, or a decode step); `pending_tracks` are decode snapshots to commit when
    the result is processed."""

    def __init__(self, reqs: list[Req], forward_mode, batch_id: int):
        self.reqs = reqs
        self.forward_mode = forward_mode
        self.batch_id = batch_id
        self.sample_rows: list[bool] = []
        self.completes_prefill: list[bool] = []  # the row computes the last input position
        self.future_slots: Sequence[int] | None = None
        self.pending_tracks: dict[int, tuple[int, int]] = {}  # row -> (track entry, seq_len)
        self.prepend_none: list[bool] = []  # the first input token's logprob (none exists) goes first
        self.state_copies: list[tuple[int, int]] = []
        self.host_copies: list | None = None  # a host tier's copies (`BasePrefixCache.take_host_copies`)
        self.forward_batch = None
        self.has_placeholders = False
        self.any_stream = True  # some request streams (decode batches know; others assume so)
        # The rows whose finish check is measured (`DecodeRows.measured_rows`; None: not known, all).
        self.measured_rows: tuple[int, ...] | None = None
        self.cached_tokens = 0  # an extend's prompt tokens the radix tree gave (the batch log's)
        self.spec_info = None  # a speculative verify's drafts (`speculative/ngram_worker.py`)
        self.num_decode_rows = 0  # a mixed batch's decode rows, its last (`mixed_chunk.py`)

    @property
    def batch_size(self) -> int:
        return len(self.reqs)

    def is_extend(self) -> bool:
        return self.forward_mode.is_extend()

    # ---- extend ------------------------------------------------------------------------------------

    def prepare_for_extend(
        self,
        spans: list[tuple[int, int]],
        tracker: SnapshotTracker,
        tree_cache: BasePrefixCache,
        inflight: InflightLedger,
        penalty_slots: PenaltySlots | None = None,
        decode: MixedDecodeRows | None = None,
    ) -> None:
        """`spans[i] = (prefix_len, end)`: request i computes positions [prefix_len, end) of its
        `fill_ids`; their KV slots were allocated at admission and sit in `kv_indices`. A penalized
        request takes its row of `penalty_slots` here if it has none. `decode`: a mixed batch's decode
        rows (scheduler_components/mixed_chunk.py), the last rows of `reqs`."""
        input_ids, out_loc, writes = [], [], []
        track: list[tuple[int, int] | None] = []
        extra_tracks: list[tuple[int, int, int]] = []
        lp_start, lp_next, lp_mask = [], [], []
        seq_lens, prefix_lens = [end for _, end in spans], [p for p, _ in spans]
        for row, (req, (p, end)) in enumerate(zip(self.reqs[: len(spans)], spans, strict=True)):
            input_ids += req.fill_ids[p:end]
            out_loc += req.kv_indices[p:end]
            writes += self._dirty_row_writes(req, p)
            snapshots = tracker.prefill_track(req, p, end)
            track.append(snapshots[-1] if snapshots else None)
            extra_tracks += [(row, slot, pos) for slot, pos in snapshots[:-1]]
            done = end == len(req.fill_ids)
            self.completes_prefill.append(done)
            self.sample_rows.append(done and req.sampling_params.max_new_tokens > len(req.output_ids))
            start, next_id, prepend = self._input_logprob_plan(req, p, end)
            lp_mask.append(req.return_logprob)
            lp_start.append(start)
            lp_next.append(next_id)
            self.prepend_none.append(prepend)
        if decode is not None:
            self.num_decode_rows = len(decode.reqs)
            ids, self.has_placeholders = inflight.decode_input_ids(decode.reqs)
            input_ids += ids
            out_loc += decode.out_cache_loc
            for req, seq_len in zip(decode.reqs, decode.seq_lens, strict=True):
                writes += self._dirty_row_writes(req, seq_len - 1)
            track += [None] * len(decode.reqs)
            for row, snapshot in self._decode_tracks(tracker, decode.reqs, decode.seq_lens, len(spans)).items():
                track[row] = snapshot
            n = len(decode.reqs)
            seq_lens += decode.seq_lens
            prefix_lens += [s - 1 for s in decode.seq_lens]
            self.sample_rows += [True] * n
            self.completes_prefill += [False] * n
            self.prepend_none += [False] * n
            lp_mask += [r.return_logprob for r in decode.reqs]
            lp_start += [0] * n  # (a one-token row: no input logprobs)
            lp_next += [None] * n
        clear, cow_src, cow_dst = self._collect_deferred_mamba_cow_and_clear()
        self.state_copies = tree_cache.take_pending_state_copies()
        self.host_copies = tree_cache.take_host_copies()
        inflight.add(self)
        self.forward_batch = ForwardBatch.create(
            self.forward_mode,
            input_ids=input_ids,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            seq_lens=seq_lens,
            out_cache_loc=out_loc,
            mamba_pool_indices=[r.mamba_pool_idx for r in self.reqs],
            extend_prefix_lens=prefix_lens,
            req_to_token_writes=writes,
            **self._track_fields(track),
            mamba_extra_tracks=extra_tracks,
            mamba_cow_src_indices=cow_src or None,
            mamba_cow_dst_indices=cow_dst or None,
            mamba_clear_indices=clear or None,
            sampling_info=self._sampling_info(),
            return_logprob_mask=lp_mask,
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in self.reqs],
            token_ids_logprobs=token_ids_logprobs(self.reqs),
            extend_logprob_start_lens=lp_start,
            extend_logprob_next_ids=lp_next,
            host_tensors=lora_host_tensors(self.reqs),
        )
        if penalty_slots is not None and any(r.penalized for r in self.reqs):
            self.forward_batch.penalties = PenaltyBatchInfo.build(
                self.reqs, seq_lens, self.sample_rows, penalty_slots
            )
        if any(r.grammar is not None for r in self.reqs):
            self.forward_batch.vocab_mask = VocabMaskInfo.build(self.reqs, self.sample_rows)
        self.forward_batch.custom_logit = CustomLogitInfo.build(self.reqs, self.sample_rows)
        self.forward_batch.return_hidden_states_mask = hidden_states_mask(self.reqs)
        if any(r.multimodal_inputs is not None for r in self.reqs):
            self.forward_batch.mm_inputs = [r.multimodal_inputs for r in self.reqs]

    @staticmethod
    def _input_logprob_plan(req: Req, p: int, end: int) -> tuple[int, int | None, bool]:
        """Runner arguments for input logprobs of positions [logprob_start_len, input length) that fall
        into this extend: (start offset, next-chunk token, prepend None for position 0)."""
        n_in, last = len(req.origin_input_ids), end - p - 1
        lp_from = req.logprob_start_len
        if not req.wants_input_logprobs():
            return last, None, False
        first = max(lp_from, p + 1)
        next_id = req.fill_ids[end] if first <= end <= n_in - 1 else None
        return min(first - 1 - p, last), next_id, lp_from == 0 and p == 0

    def _collect_deferred_mamba_cow_and_clear(self) -> tuple[list[int], list[int], list[int]]:
        """Fresh running slots to zero and checkpoints to copy into running slots, both run on the
        forward stream before the first layer of this extend reads them."""
        clear, src, dst = [], [], []
        for req in self.reqs:
            if req.mamba_cow_src_index is not None:
                src.append(req.mamba_cow_src_index)
                dst.append(req.mamba_pool_idx)
            elif req.mamba_needs_clear:
                clear.append(req.mamba_pool_idx)
            req.mamba_cow_src_index = None
            req.mamba_needs_clear = False
        return clear, src, dst

    # ---- decode ------------------------------------------------------------------------------------

    def prepare_for_decode(
        self,
        out_cache_loc: list[int],
        seq_lens: list[int],
        tracker: SnapshotTracker,
        tree_cache: BasePrefixCache,
        inflight: InflightLedger,
        fast_path: DecodeShortcuts | None = None,
        penalty_slots: PenaltySlots | None = None,
    ) -> None:
        """One token per request at position kv_len - 1; its KV slot, `out_cache_loc[i]`, and its KV
        length, `seq_lens[i]`, come from `alloc_for_decode`. (This runs for every running request at
        every step: each pass over the requests' objects costs ~0.1-0.2 us per request.) `fast_path`: the
        scheduler's decode shortcuts, flushed here before the requests' lists are read (not in the
        steady step), and its rows cache."""
        reqs, n = self.reqs, len(self.reqs)
        ids = inflight.steady_decode_input_ids(reqs)
        if ids is None:
            if fast_path is not None:
                fast_path.flush()  # the newest tokens are read from the requests' output_ids
            ids = inflight.decode_input_ids(reqs)
        input_ids, self.has_placeholders = ids
        writes = []
        for row, req in enumerate(reqs):
            if req.req_to_token_dirty_from is not None:
                if fast_path is not None:
                    fast_path.flush()  # the rewrite reads the list
                writes += self._dirty_row_writes(req, seq_lens[row] - 1)
        self.sample_rows = [True] * n
        self.completes_prefill = [False] * n
        track = self.set_mamba_track_indices_from_reqs(tracker, seq_lens)
        inflight.add(self)
        rows = fast_path.rows_cache.get(reqs) if fast_path is not None else DecodeRows.of(reqs)
        self.any_stream, self.measured_rows = rows.any_stream, rows.measured_rows
        self.forward_batch = ForwardBatch.create(
            self.forward_mode,
            input_ids=input_ids,
            req_pool_indices=rows.req_pool_indices,
            seq_lens=seq_lens,
            out_cache_loc=out_cache_loc,
            mamba_pool_indices=rows.mamba_pool_indices,
            req_to_token_writes=writes,
            **track,
            sampling_info=rows.sampling_info,  # shared: `to_device` moves a copy
            return_logprob_mask=rows.return_logprob_mask,
            top_logprobs_nums=rows.top_logprobs_nums,
            token_ids_logprobs=rows.token_ids_logprobs,
            host_tensors=rows.host_tensors,
        )
        if rows.any_penalized and penalty_slots is not None:
            self.forward_batch.penalties = PenaltyBatchInfo.build(
                reqs, seq_lens, self.sample_rows, penalty_slots
            )
        if rows.any_grammar:
            self.forward_batch.vocab_mask = VocabMaskInfo.build(reqs, self.sample_rows)
        if rows.any_custom_logit:
            self.forward_batch.custom_logit = CustomLogitInfo.build(reqs, self.sample_rows)
        self.forward_batch.return_hidden_states_mask = rows.hidden_states_mask
        self.state_copies = tree_cache.take_pending_state_copies()
        self.host_copies = tree_cache.take_host_copies()

    def set_mamba_track_indices_from_reqs(self, tracker: SnapshotTracker, seq_lens: list[int]) -> dict:
        """Decode snapshots: rows whose step ends on a track boundary write the state into a track slot
        (lazy mode borrows it here); the snapshot is committed when the result is processed. Returns
        the batch's track fields."""
        tracks = self._decode_tracks(tracker, self.reqs, seq_lens, 0)
        if not tracks:
            return {}
        n = len(seq_lens)
        # Dense per-row fields, written at the few tracked rows only (a step of staggered requests has
        # some at almost every step).
        fields = {
            "mamba_track_indices": [0] * n,
            "mamba_track_mask": [False] * n,
            "mamba_track_seqlens": [0] * n,
        }
        for i, (slot, seq_len) in tracks.items():
            fields["mamba_track_indices"][i] = slot
            fields["mamba_track_mask"][i] = True
            fields["mamba_track_seqlens"][i] = seq_len
        return fields

    def _decode_tracks(
        self, tracker: SnapshotTracker, reqs: list[Req], seq_lens: list[int], first_row: int
    ) -> dict[int, tuple[int, int]]:
        """The decode snapshots of `reqs` (batch rows from `first_row` on), each step after `seq_lens[i]`
        tokens: {row: (track slot, seq_len)}, their commits recorded in `pending_tracks`."""
        tracks = {}
        for i in tracker.boundary_rows(seq_lens):
            t = tracker.decode_track(reqs[i], seq_lens[i])
            if t is not None:
                slot, entry = t
                row = first_row + i
                self.pending_tracks[row] = (entry, seq_lens[i])
                tracks[row] = (slot, seq_lens[i])
        return tracks

    # ---- shared ------------------------------------------------------------------------------------

    @staticmethod
    def _dirty_row_writes(req: Req, end: int) -> list[tuple[int, int, list[int]]]:
        """The rewrite of `req`'s row from its first dirty position up to `end` (the positions this
        forward writes itself follow), e.g. after the tree replaced KV the request had computed with
        its own copies of the same tokens."""
        dirty, req.req_to_token_dirty_from = req.req_to_token_dirty_from, None
        if dirty is None or dirty >= end:
            return []
        return [(req.req_pool_idx, dirty, req.kv_indices[dirty:end])]

    @staticmethod
    def _track_fields(track: list[tuple[int, int] | None]) -> dict:
        if not any(t is not None for t in track):
            return {}
        return {
            "mamba_track_indices": [t[0] if t else 0 for t in track],
            "mamba_track_mask": [t is not None for t in track],
            "mamba_track_seqlens": [t[1] if t else 0 for t in track],
        }

    def _sampling_info(self) -> SamplingBatchInfo:
        temps, top_ps, top_ks, seeds, min_ps, *_ = sampling_columns(self.reqs)
        return SamplingBatchInfo.create(temps, top_ps, top_ks, seeds, min_ps)
