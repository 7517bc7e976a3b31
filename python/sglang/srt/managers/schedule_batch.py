"""`Req` (one request's scheduling state, SGLang's field names) and `ScheduleBatch` (one forward's worth
of requests, turned into a `ForwardBatch`).

KV bookkeeping on the host: `kv_indices[i]` is the KV slot of position i for every position a forward
has been scheduled for. Positions [0, cache_protected_len) are owned by the radix tree and locked
through `last_node`; later positions are the request's own. `req_to_token_dirty_from` is the first
position whose device row entry must be (re)written by the next forward (on the forward stream).

Mamba fields (upstream names):
  mamba_pool_idx                running slot (host int), or None
  mamba_ping_pong_track_buffer  track slots (list of ints, -1 = empty entry), or None
  mamba_next_track_idx          the entry the next snapshot is written to
  mamba_last_track_seqlen       sequence length whose state the keep entry holds (None: nothing)
  mamba_branching_seqlen        chunk-aligned end of a KV match deeper than its checkpoint
  mamba_cow_src_index           checkpoint slot to copy into the running slot (deferred to the forward)
  mamba_needs_clear             the running slot is fresh and must be zeroed (deferred to the forward)
  mamba_lazy_is_insert          lazy mode: false while the newest snapshot may be unsafe to insert
  mamba_extra_snapshots         (slot, position) of prefill snapshots beyond the primary one, in slots
                                borrowed for them until the tree takes them over

Overlap: a request's newest sampled token may still be in flight (`inflight_tokens` > 0); a decode
batch then names it by a placeholder (-(future slot + 1)) that the forward stream resolves. What is in
flight for a request is the scheduler's `InflightBatches` (`Req.inflight`), not counted on the request.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sglang.srt.constrained.vocab_mask import VocabMaskInfo
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, SamplingBatchInfo
from sglang.srt.sampling.custom_logit_processor import CustomLogitInfo, CustomLogitProcessor
from sglang.srt.sampling.penaltylib import PenaltyBatchInfo, PenaltySlots, is_penalized
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils.host_tensors import host_int64

if TYPE_CHECKING:
    from sglang.srt.constrained.xgrammar_backend import RequestGrammar
    from sglang.srt.managers.io_struct import BootstrapInfo
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool


class SnapshotTracker(Protocol):
    """What a batch asks of the scheduler's `MambaTracker` (kept structural so that this module, which
    the tracker reads `Req` from, does not import it back)."""

    def prefill_track(self, req: Req, prefix_len: int, end: int) -> list[tuple[int, int]]: ...

    def decode_track(self, req: Req, seq_len: int) -> tuple[int, int] | None: ...

    def boundary_rows(self, seq_lens: list[int]) -> list[int]: ...


class InflightLedger(Protocol):
    """What a request and a batch ask of the scheduler's `InflightBatches` (structural, as above)."""

    def add(self, batch: ScheduleBatch) -> None: ...

    def decode_input_ids(self, reqs: list[Req]) -> tuple[Sequence[int], bool]: ...

    def num_inflight(self, req: Req) -> int: ...

    def inflight_tokens(self, req: Req) -> int: ...


class DecodeKVLedger(Protocol):
    """What a request asks of the scheduler's `DecodeKVLog` (mem_cache/decode_kv_log.py)."""

    pending: list  # the steps not yet appended: a request with a log looks here first

    def append_pending(self, req: Req) -> None: ...

    def replaced(self, req: Req, kv_indices: list[int]) -> None: ...


class DecodeTokenLedger(Protocol):
    """What a request asks of the scheduler's `DecodeTokenLog` (scheduler_components/decode_token_log.py)."""

    pending: list  # the steps not yet appended: a request with a log looks here first

    def append_pending(self, req: Req) -> None: ...


class Req:
    # Slots, not a __dict__: the scheduler touches a few of these per request at every step, and a
    # compact object keeps them in fewer cache lines (the forward runs on the same core on CPU).
    __slots__ = (
        "rid",
        "origin_input_ids",
        "_output_ids",
        "token_log",
        "sampling_params",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "token_ids_logprob",
        "stream",
        "created_time",
        "bootstrap",
        "fill_ids",
        "finished_reason",
        "finish_check_len",
        "finish_token_ids",
        "inflight",
        "decode_until",
        "release_deferred",
        "req_pool_idx",
        "_kv_indices",
        "kv_log",
        "cache_protected_len",
        "last_node",
        "req_to_token_dirty_from",
        "cached_tokens",
        "admitted_once",
        "mamba_pool_idx",
        "mamba_ping_pong_track_buffer",
        "mamba_next_track_idx",
        "mamba_last_track_seqlen",
        "mamba_branching_seqlen",
        "mamba_cow_src_index",
        "mamba_needs_clear",
        "mamba_lazy_is_insert",
        "mamba_extra_snapshots",
        "output_token_logprobs",
        "output_top_logprobs",
        "input_token_logprobs",
        "input_top_logprobs",
        "output_token_ids_logprobs",
        "input_token_ids_logprobs",
        "send_offset",
        "input_logprobs_sent",
        "sampling_row",
        "penalized",
        "penalty_slot",
        "spec_counts",
        "extra_key",
        "grammar",
        "return_hidden_states",
        "custom_logit_processor",
        "custom_logit_error",
        "custom_logit_state",
        "hidden_count",
        "hidden_unsent",
    )

    def __init__(
        self,
        rid: str,
        origin_input_ids: list[int],
        sampling_params: SamplingParams | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        stream: bool = False,
        token_ids_logprob: list[int] | None = None,
    ):
        self.rid = rid
        self.origin_input_ids = list(origin_input_ids)
        self._output_ids: list[int] = []  # `output_ids`
        # The scheduler's `DecodeTokenLog` once the request decodes: its newest tokens may be there, not
        # yet in `_output_ids`. None: everything is in the list.
        self.token_log: DecodeTokenLedger | None = None
        self.sampling_params = sampling_params or SamplingParams()
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.token_ids_logprob = token_ids_logprob  # with return_logprob: these ids' logprobs too
        self.stream = stream
        self.created_time = time.monotonic()
        self.bootstrap: BootstrapInfo | None = None  # PD disaggregation: where the other half runs

        # Lifecycle
        self.fill_ids: list[int] = []  # the tokens the current prefill covers (input + outputs so far)
        self.finished_reason: dict[str, Any] | None = None
        # Set by `FinishChecker.check_finished` on its first call: below `finish_check_len` output
        # tokens and for a token not in `finish_token_ids`, the check cannot end the request (0: always
        # check).
        self.finish_check_len = 0
        self.finish_token_ids: frozenset[int] | None = None
        # The scheduler's batches in flight (`InflightBatches`), set when it takes the request; None:
        # no scheduler, nothing in flight.
        self.inflight: InflightLedger | None = None
        self.decode_until = -1  # the scheduler's decode selection certificate (`DecodeSetCache`)
        self.release_deferred = False  # finished; releases when no batch in flight contains it

        # KV and radix cache
        self.req_pool_idx: int | None = None
        self._kv_indices: list[int] = []  # `kv_indices`
        # The scheduler's `DecodeKVLog` once the request decodes: its newest decode slots may be there,
        # not yet in `_kv_indices`. None: everything is in the list.
        self.kv_log: DecodeKVLedger | None = None
        self.cache_protected_len = 0
        self.last_node: Any = None
        self.req_to_token_dirty_from: int | None = None
        self.cached_tokens = 0
        self.admitted_once = False
        # The prefix-cache namespace (upstream's `cache_salt + extra_key`): the radix tree matches and
        # inserts this request's tokens among those of its namespace only; None: the shared one.
        self.extra_key: str | None = None

        # Mamba state
        self.mamba_pool_idx: int | None = None
        self.mamba_ping_pong_track_buffer: list[int] | None = None
        self.mamba_next_track_idx = 0
        self.mamba_last_track_seqlen: int | None = None
        self.mamba_branching_seqlen: int | None = None
        self.mamba_cow_src_index: int | None = None
        self.mamba_needs_clear = False
        self.mamba_lazy_is_insert = True
        self.mamba_extra_snapshots: list[tuple[int, int]] = []

        # Outputs and what has been sent
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.output_token_ids_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_ids_logprobs: list[list[tuple[float, int]] | None] = []
        self.send_offset = 0
        self.input_logprobs_sent = False
        # Speculative decoding (`NgramWorker`): [drafts proposed, then at index k >= 1 the verifies that
        # accepted k drafts]; None until its first verify.
        self.spec_counts: list[int] | None = None
        # What a batch reads of this request's sampling options (`_make_sampling_row`).
        self.sampling_row: tuple | None = None
        # Logit penalties (sampling/penaltylib.py): whether any applies, and the request's row of the
        # output token counts (the scheduler's `PenaltySlots`; kept across retraction).
        self.penalized = is_penalized(self.sampling_params)
        self.penalty_slot: int | None = None
        # Constrained decoding: the matcher of its grammar (`constrained/xgrammar_backend.py`), set once
        # the scheduler compiled it.
        self.grammar: RequestGrammar | None = None
        # return_hidden_states: how many positions' final hidden states it has, from 0 on (a retracted
        # request recomputes none of them: admission matches its prefix up to there), and the rows not
        # sent yet (tensors [n, hidden] on the host; the scheduler keeps none after sending them).
        self.return_hidden_states = False
        # --enable-custom-logit-processor: the processor its logits go through (sampling/
        # custom_logit_processor.py), and why it failed if it raised (the finish check ends it then).
        self.custom_logit_processor: CustomLogitProcessor | None = None
        self.custom_logit_error: str | None = None
        self.custom_logit_state: Any = None  # the processor's own, kept across steps (e.g. a scan)
        self.hidden_count = 0
        self.hidden_unsent: list[torch.Tensor] = []

    # ---- derived -----------------------------------------------------------------------------------

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def output_ids(self) -> list[int]:
        """The tokens sampled so far (the newest decode steps' appended first from the scheduler's
        `DecodeTokenLog`, where they wait while no request of the decode set can finish)."""
        log = self.token_log
        if log is not None and log.pending:
            log.append_pending(self)
        return self._output_ids

    @output_ids.setter
    def output_ids(self, value: list[int]) -> None:
        log = self.token_log
        if log is not None and log.pending:
            log.append_pending(self)  # so that they are not appended to the new list later
        self._output_ids = value

    @property
    def kv_indices(self) -> list[int]:
        """The KV slot of each position scheduled so far (the decode steps' newest ones appended first
        from the scheduler's `DecodeKVLog`, where they wait while the decode set is unchanged)."""
        log = self.kv_log
        if log is not None and log.pending:
            log.append_pending(self)
        return self._kv_indices

    @kv_indices.setter
    def kv_indices(self, value: list[int]) -> None:
        log = self.kv_log
        if log is not None:
            if log.pending:
                log.append_pending(self)  # so that they are not appended to the new list later
            log.replaced(self, value)
        self._kv_indices = value

    @property
    def kv_len(self) -> int:
        return len(self.kv_indices)

    @property
    def prefill_done(self) -> bool:
        return bool(self.fill_ids) and self.kv_len >= len(self.fill_ids)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    @property
    def num_inflight(self) -> int:
        """Batches in flight that contain this request."""
        return 0 if self.inflight is None else self.inflight.num_inflight(self)

    @property
    def inflight_tokens(self) -> int:
        """Tokens the batches in flight will sample for this request."""
        return 0 if self.inflight is None else self.inflight.inflight_tokens(self)

    @property
    def planned_output_len(self) -> int:
        return len(self.output_ids) + self.inflight_tokens

    def wants_input_logprobs(self) -> bool:
        """Input logprobs still to compute: asked for, and not all done (a retracted request that
        prefills again has them already)."""
        start, n_in = self.logprob_start_len, len(self.origin_input_ids)
        if not self.return_logprob or start < 0 or start >= n_in:
            return False
        return len(self.input_token_logprobs) < n_in - start

    def mark_req_to_token_dirty(self, start: int) -> None:
        if self.req_to_token_dirty_from is None or start < self.req_to_token_dirty_from:
            self.req_to_token_dirty_from = start

    def init_next_round_input(self) -> None:
        """A (re)admitted request prefills its input and every output committed so far."""
        self.fill_ids = self.all_ids

    def reset_for_retract(self) -> None:
        """Back to the waiting queue: everything held was released; it will prefill again."""
        self.fill_ids = []
        self.decode_until = -1  # its prefill again samples a token outside any decode batch
        self.kv_indices = []
        self.cache_protected_len = 0
        self.last_node = None
        self.req_to_token_dirty_from = None
        self.mamba_last_track_seqlen = None
        self.mamba_branching_seqlen = None
        self.mamba_cow_src_index = None
        self.mamba_needs_clear = False
        self.mamba_lazy_is_insert = True

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"


@dataclasses.dataclass(slots=True)
class DecodeRows:
    """A decode batch's per-request values that stay the same from step to step while the same requests
    decode in the same order: request rows and running slots (lists, and their host tensors by
    `ForwardBatch` field name), sampling parameters and logprob options."""

    req_pool_indices: list[int]
    mamba_pool_indices: list[int]
    host_tensors: dict[str, torch.Tensor]
    sampling_info: SamplingBatchInfo
    return_logprob_mask: list[bool]
    top_logprobs_nums: list[int]
    token_ids_logprobs: list[tuple[int, ...] | None] | None  # None: no request asks
    any_stream: bool  # some request streams its output
    any_penalized: bool  # some request's logits take penalties (sampling/penaltylib.py)
    any_grammar: bool  # some request has a grammar (constrained/vocab_mask.py)
    any_custom_logit: bool  # some request has a custom logit processor
    hidden_states_mask: list[bool] | None  # `hidden_states_mask`

    @classmethod
    def of(cls, reqs: list[Req], uniform_infos: dict | None = None) -> DecodeRows:
        """Read from the requests. `uniform_infos` keeps the sampling info of batches whose requests all
        sample alike, by (sampling row, batch size): such a batch (one client's settings, or the
        defaults) then reuses it instead of building its tensors again."""
        n = len(reqs)
        rows = [r.req_pool_idx for r in reqs]
        slots = [r.mamba_pool_idx for r in reqs]
        sampling = sampling_rows(reqs)
        # Interned rows: alike requests hold the same tuple, so the count compares identities (values,
        # slower but still right, for requests from before the interning table was last emptied).
        if n and sampling.count(sampling[0]) == n:
            row = sampling[0]
            key = (row, n)
            info = uniform_infos.get(key) if uniform_infos is not None else None
            if info is None:
                info = SamplingBatchInfo.create(*([v] * n for v in row[:5]))
                if uniform_infos is not None:
                    if len(uniform_infos) >= 16:
                        uniform_infos.clear()
                    uniform_infos[key] = info
            logprob_mask, top_nums, any_stream = [row[5]] * n, [row[6]] * n, row[7]
            any_penalized = row[8]
            token_ids = None if row[9] is None else [row[9]] * n
        else:
            temps, top_ps, top_ks, seeds, min_ps, logprob, top, stream, penalized, ids = _columns(sampling)
            info = SamplingBatchInfo.create(temps, top_ps, top_ks, seeds, min_ps)
            logprob_mask, top_nums, any_stream = list(logprob), list(top), any(stream)
            any_penalized = any(penalized)
            token_ids = list(ids) if ids.count(None) < n else None
        return cls(
            req_pool_indices=rows,
            mamba_pool_indices=slots,
            host_tensors={"req_pool_indices": host_int64(rows), "mamba_pool_indices": host_int64(slots)},
            sampling_info=info,
            return_logprob_mask=logprob_mask,
            top_logprobs_nums=top_nums,
            token_ids_logprobs=token_ids,
            any_stream=any_stream,
            any_penalized=any_penalized,
            any_grammar=any(r.grammar is not None for r in reqs),
            any_custom_logit=any(r.custom_logit_processor is not None for r in reqs),
            hidden_states_mask=hidden_states_mask(reqs),
        )


class DecodeRowsCache:
    """The decode batches' `DecodeRows`, kept while the batch's requests are the same ones in the same
    order (every step, between arrivals and finishes) and no request's row or running slot changed
    (the request pool's `slot_epoch`): building them costs ~0.2 us per request per step. The rows are
    shared by the batches that get them; each batch copies what it may change (`prepare_for_decode`)."""

    def __init__(self, req_to_token_pool: ReqToTokenPool):
        self.pool = req_to_token_pool
        self._reqs: list[Req] = []
        self._epoch = -1
        self._rows: DecodeRows | None = None
        self._uniform_infos: dict = {}  # see `DecodeRows.of`

    def get(self, reqs: list[Req]) -> DecodeRows:
        epoch = self.pool.slot_epoch
        # List equality: one C loop over the request objects (compared by identity).
        if self._rows is None or epoch != self._epoch or reqs != self._reqs:
            rows = DecodeRows.of(reqs, self._uniform_infos)
            self._reqs, self._epoch, self._rows = list(reqs), epoch, rows
        return self._rows

    def clear(self) -> None:
        self._reqs, self._rows = [], None


def hidden_states_mask(reqs: Sequence[Req]) -> list[bool] | None:
    """Which requests return their hidden states (`ForwardBatch.return_hidden_states_mask`); None: none."""
    mask = [r.return_hidden_states for r in reqs]
    return mask if any(mask) else None


def sampling_rows(reqs: list[Req]) -> list[tuple]:
    """Each request's sampling and output options: temperature (0 for greedy, top_k 1 included), top_p,
    top_k, seed, min_p, return_logprob, top logprobs wanted, stream, penalized, the token ids whose
    logprobs are wanted (a tuple, or None). A request's row is made once (its options do not change),
    so a batch whose requests changed reads one attribute per request."""
    return [r.sampling_row or _make_sampling_row(r) for r in reqs]


def sampling_columns(reqs: list[Req]) -> list[tuple]:
    """`sampling_rows` by column."""
    return _columns(sampling_rows(reqs))


def _columns(rows: list[tuple]) -> list[tuple]:
    return list(zip(*rows, strict=True)) if rows else [()] * 10


_SAMPLING_ROWS: dict[tuple, tuple] = {}  # interned rows (a bounded set of immutable tuples)


def _token_ids_logprobs(reqs: list[Req]) -> list[tuple[int, ...] | None] | None:
    """Each request's token ids whose logprobs it wants (None: no request wants any)."""
    ids = [row[9] for row in sampling_rows(reqs)]
    return ids if ids.count(None) < len(ids) else None


def _make_sampling_row(req: Req) -> tuple:
    sp = req.sampling_params
    row = (
        0.0 if sp.is_greedy else sp.temperature,
        sp.top_p,
        sp.top_k,
        sp.sampling_seed,
        sp.min_p,
        req.return_logprob,
        req.top_logprobs_num if req.return_logprob else 0,
        req.stream,
        req.penalized,
        tuple(req.token_ids_logprob) if req.return_logprob and req.token_ids_logprob else None,
    )
    if len(_SAMPLING_ROWS) >= 1024:
        _SAMPLING_ROWS.clear()
    req.sampling_row = _SAMPLING_ROWS.setdefault(row, row)
    return req.sampling_row


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
        self.forward_batch = None
        self.has_placeholders = False
        self.any_stream = True  # some request streams (decode batches know; others assume so)
        self.cached_tokens = 0  # an extend's prompt tokens the radix tree gave (the batch log's)
        self.spec_info = None  # a speculative verify's drafts (`speculative/ngram_worker.py`)

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
    ) -> None:
        """`spans[i] = (prefix_len, end)`: request i computes positions [prefix_len, end) of its
        `fill_ids`; their KV slots were allocated at admission and sit in `kv_indices`. A penalized
        request takes its row of `penalty_slots` here if it has none."""
        input_ids, out_loc, writes = [], [], []
        track: list[tuple[int, int] | None] = []
        extra_tracks: list[tuple[int, int, int]] = []
        lp_start, lp_next, lp_mask = [], [], []
        for row, (req, (p, end)) in enumerate(zip(self.reqs, spans, strict=True)):
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
        clear, cow_src, cow_dst = self._collect_deferred_mamba_cow_and_clear()
        self.state_copies = tree_cache.take_pending_state_copies()
        inflight.add(self)
        self.forward_batch = ForwardBatch.create(
            self.forward_mode,
            input_ids=input_ids,
            req_pool_indices=[r.req_pool_idx for r in self.reqs],
            seq_lens=[end for _, end in spans],
            out_cache_loc=out_loc,
            mamba_pool_indices=[r.mamba_pool_idx for r in self.reqs],
            extend_prefix_lens=[p for p, _ in spans],
            req_to_token_writes=writes,
            **self._track_fields(track),
            mamba_extra_tracks=extra_tracks,
            mamba_cow_src_indices=cow_src or None,
            mamba_cow_dst_indices=cow_dst or None,
            mamba_clear_indices=clear or None,
            sampling_info=self._sampling_info(),
            return_logprob_mask=lp_mask,
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in self.reqs],
            token_ids_logprobs=_token_ids_logprobs(self.reqs),
            extend_logprob_start_lens=lp_start,
            extend_logprob_next_ids=lp_next,
        )
        if penalty_slots is not None and any(r.penalized for r in self.reqs):
            seq_lens = [end for _, end in spans]
            self.forward_batch.penalties = PenaltyBatchInfo.build(
                self.reqs, seq_lens, self.sample_rows, penalty_slots
            )
        if any(r.grammar is not None for r in self.reqs):
            self.forward_batch.vocab_mask = VocabMaskInfo.build(self.reqs, self.sample_rows)
        self.forward_batch.custom_logit = CustomLogitInfo.build(self.reqs, self.sample_rows)
        self.forward_batch.return_hidden_states_mask = hidden_states_mask(self.reqs)

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
        rows_cache: DecodeRowsCache | None = None,
        penalty_slots: PenaltySlots | None = None,
    ) -> None:
        """One token per request at position kv_len - 1; its KV slot, `out_cache_loc[i]`, and its KV
        length, `seq_lens[i]`, come from `alloc_for_decode`. (This runs for every running request at
        every step: each pass over the requests' objects costs ~0.1-0.2 us per request.)"""
        reqs, n = self.reqs, len(self.reqs)
        input_ids, self.has_placeholders = inflight.decode_input_ids(reqs)
        writes = []
        for req in reqs:
            if req.req_to_token_dirty_from is not None:
                writes += self._dirty_row_writes(req, len(req.kv_indices) - 1)
        self.sample_rows = [True] * n
        self.completes_prefill = [False] * n
        track = self.set_mamba_track_indices_from_reqs(tracker, seq_lens)
        inflight.add(self)
        rows = rows_cache.get(reqs) if rows_cache is not None else DecodeRows.of(reqs)
        self.any_stream = rows.any_stream
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

    def set_mamba_track_indices_from_reqs(self, tracker: SnapshotTracker, seq_lens: list[int]) -> dict:
        """Decode snapshots: rows whose step ends on a track boundary write the state into a track slot
        (lazy mode borrows it here); the snapshot is committed when the result is processed. Returns
        the batch's track fields."""
        rows = tracker.boundary_rows(seq_lens)
        if not rows:
            return {}
        n = len(seq_lens)
        # Dense per-row fields, written at the few tracked rows only (a step of staggered requests has
        # some at almost every step).
        fields = {
            "mamba_track_indices": [0] * n,
            "mamba_track_mask": [False] * n,
            "mamba_track_seqlens": [0] * n,
        }
        tracked = False
        for i in rows:
            req, seq_len = self.reqs[i], seq_lens[i]
            t = tracker.decode_track(req, seq_len)
            if t is not None:
                slot, entry = t
                self.pending_tracks[i] = (entry, seq_len)
                fields["mamba_track_indices"][i] = slot
                fields["mamba_track_mask"][i] = True
                fields["mamba_track_seqlens"][i] = seq_len
                tracked = True
        return fields if tracked else {}

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
