"""Processing a batch's results on the scheduler: commit sampled tokens and logprobs, decide finishes,
commit decode snapshots, release finished requests, and stream deltas out.

Order per request (`commit`, then `settle`): the finish state is updated first, then
`_mamba_prefix_cache_update` commits a snapshot the batch wrote, then a finished request is released
with `release_kv_cache(req, tree, is_insert=...)` (is_insert false for an abort), so a request that
finishes on a track boundary inserts the state of that very step.

A request may already be gone when its batch is processed (aborted, or finished by the previous batch
while this one was in flight, under overlap): its row is ignored, except that a finished request whose
release waited for this batch (`release_finished`) is released now. A request retracted while the batch
was in flight still commits the token it sampled, and may finish on it (it holds nothing to release);
otherwise it prefills that token again when readmitted.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sglang.srt.managers.finish_checker import FinishChecker
from sglang.srt.managers.io_struct import BatchTokenIDOut
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler_components.mamba_tracking import MambaTracker
from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
from sglang.srt.mem_cache.common import release_kv_cache

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler_components.decode_token_log import DecodeTokenLog
    from sglang.srt.model_executor.forward_worker import HostBatchResult

logger = logging.getLogger(__name__)


class DecodeLogs(Protocol):
    """What the result processor asks of the scheduler's `DecodeFastPath` (structural: that module
    imports `commit_logged` from here)."""

    token_log: DecodeTokenLog

    def flush(self, req: Req | None = None) -> None: ...

    def clear(self) -> None: ...


class BatchResultProcessor:
    def __init__(
        self,
        tree_cache: BasePrefixCache,
        tracker: MambaTracker,
        finisher: FinishChecker,
        output_sink: Callable[[Any], None],
        on_release: Callable[[Req], None],
        counters: dict[str, int],
        stream_interval: int,
        fast_path: DecodeLogs,
    ):
        self.tree_cache = tree_cache
        self.tracker = tracker
        self.finisher = finisher
        self.output_sink = output_sink  # to the detokenizer
        self.on_release = on_release  # the scheduler forgets a released request
        self.counters = counters
        self.stream_interval = stream_interval
        # The scheduler's decode shortcuts: its logs hold decode steps not yet in the requests' lists
        # (`decode_fast_path.py`), and its token log, steps whose tokens only wait to be committed.
        self.fast_path = fast_path
        self.token_log = fast_path.token_log
        # PD prefill server: takes a disaggregated request once its prompt is done (it decodes elsewhere).
        self.prefill_handoff: Callable[[Req], None] | None = None
        # Finished requests whose release waits for a batch in flight (`release_finished`): they still
        # hold their KV and slots.
        self.deferred_releases: list[Req] = []
        # --enable-return-routed-experts: the model runner's table (`model_executor/routed_experts.py`).
        self.routed_experts: Any = None
        # The scheduler drops a grammar with nothing left to mask (`Scheduler.release_grammar`).
        self.release_grammar: Callable[[Req], None] = lambda req: None
        # Speculative decoding: commits a verify batch's result (`speculative/ngram_worker.py`).
        self.process_verify: Callable[[ScheduleBatch, HostBatchResult], None] | None = None

    def process_batch_result(self, batch: ScheduleBatch, result: HostBatchResult) -> None:
        """Each kind of batch measures its rows' output checks at once before it commits them
        (`FinishChecker.precheck`: under TP one agreement of the ranks per batch)."""
        try:
            if batch.forward_mode.is_target_verify():
                self.process_verify(batch, result)
            elif batch.forward_mode.is_decode():
                self.process_batch_result_decode(batch, result)
            else:
                self.process_batch_result_prefill(batch, result)
        finally:
            self.finisher.clear_prechecks()

    def process_batch_result_prefill(self, batch: ScheduleBatch, result: HostBatchResult) -> None:
        # This runs for every request of every batch: the batch's lists and the checks that do not
        # change between rows are read once.
        input_logprobs = result.input_token_logprobs is not None
        hidden = result.hidden_states
        sample_rows, completes_prefill = batch.sample_rows, batch.completes_prefill
        handoff, next_ids = self.prefill_handoff, result.next_token_ids
        touched: list[Req] = []
        generated = 0
        first_decode = len(batch.reqs) - batch.num_decode_rows  # a mixed batch's decode rows (`mixed_chunk.py`)
        if batch.num_decode_rows:
            # Its decode rows commit outside the decode logs: the steps those hold go in first.
            self.fast_path.clear()
        # The rows checked below (a PD hand-off's first token is the decode server's to check).
        self.finisher.precheck(
            (req, next_ids[i] if sample_rows[i] else None)
            for i, req in enumerate(batch.reqs)
            if (sample_rows[i] or completes_prefill[i])
            and not (completes_prefill[i] and req.bootstrap is not None and handoff is not None)
        )
        for i, req in enumerate(batch.reqs):
            sampled = sample_rows[i]
            if req.finished_reason is not None:
                self.release_landed(req)
                continue
            if i >= first_decode:  # as `process_batch_result_decode` commits a row
                self.commit(req, next_ids[i], result, i, None if hidden is None else hidden[i])
                self.settle(req, batch.pending_tracks.get(i))
                generated += 1
                if req.stream or req.finished_reason is not None:
                    touched.append(req)
                continue
            if input_logprobs:
                self._add_input_logprobs(req, batch, result, i)
            if hidden is not None and hidden[i] is not None:
                add_hidden_states(req, hidden[i], batch.forward_batch.extend_prefix_lens_cpu[i])
            completes = completes_prefill[i]
            # The decode server checks a handed-over request's first token.
            handing_off = completes and req.bootstrap is not None and handoff is not None
            if sampled or (completes and not handing_off):
                # (A prefill that completes without sampling, its max_new_tokens reached, is checked.)
                token = next_ids[i] if sampled else None
                self.commit(req, token, result, i, check="none" if handing_off else "full")
                generated += sampled
            if handing_off:
                handoff(req)
                continue
            if req.finished_reason is not None:  # (extends write no decode snapshots to commit)
                self.settle(req, None)
            if req.stream or req.finished_reason is not None:
                touched.append(req)  # what stream_output may send
        self.counters["num_generation_tokens_total"] += generated
        self.stream_output(touched)

    def process_batch_result_decode(self, batch: ScheduleBatch, result: HostBatchResult) -> None:
        """`process_batch_result_prefill` for a batch whose every row sampled a token and none has
        input logprobs: this runs for every running request at every step, so its loop is the short
        one, and `check_finished` runs only where the quick check (`set_quick_check`) says it may end
        the request. Most steps have no logprobs, snapshots or streams to handle: their loop is
        shorter still (`_commit_decode_tokens`), and while no request can finish on a step its tokens
        are only logged (`DecodeTokenLog`)."""
        log = self.token_log
        hidden = result.hidden_states
        short = (
            result.next_token_logprobs is None
            and not batch.pending_tracks
            and not batch.any_stream
            and hidden is None
        )
        if short and log.log(batch.reqs, result.next_token_ids):
            self.counters["num_generation_tokens_total"] += len(batch.reqs)
            return
        commit_logged(log)  # the loops below read the lists themselves
        measured = measured_rows(batch)
        if measured:  # (a decode set without grammars, stop_regex or processors: no scan)
            reqs, ids = batch.reqs, result.next_token_ids
            self.finisher.precheck([(reqs[i], ids[i]) for i in measured])
        if short:
            self._commit_decode_tokens(batch, result)
            return
        pending, commit = batch.pending_tracks, self.commit
        touched: list[Req] = []
        skipped = finished = 0
        for i, (req, token) in enumerate(zip(batch.reqs, result.next_token_ids, strict=True)):
            if req.finished_reason is not None:
                skipped += 1
                self.release_landed(req)
                continue
            commit(req, token, result, i, None if hidden is None else hidden[i])
            # Only the rows with a snapshot to commit, or that finished, have more to do.
            if pending and i in pending:
                self.settle(req, pending[i])
            elif req.finished_reason is not None:
                self.settle(req, None)
            if req.stream or req.finished_reason is not None:
                touched.append(req)  # what stream_output may send
                finished += req.finished_reason is not None
        self.counters["num_generation_tokens_total"] += len(batch.reqs) - skipped
        log.after_step(batch.reqs, clean=not skipped and not finished)
        self.stream_output(touched)

    def _commit_decode_tokens(self, batch: ScheduleBatch, result: HostBatchResult) -> None:
        """The decode loop for a batch without logprobs, snapshots to commit or streaming requests:
        commit each token, and only a request that finishes on it has more to do (release, send)."""
        commit = self.commit
        finished: list[Req] = []
        skipped = 0
        for req, token in zip(batch.reqs, result.next_token_ids, strict=True):
            if req.finished_reason is not None:
                skipped += 1
                self.release_landed(req)
                continue
            if commit(req, token):
                self.settle(req, None)
                finished.append(req)
        self.counters["num_generation_tokens_total"] += len(batch.reqs) - skipped
        self.token_log.after_step(batch.reqs, clean=not skipped and not finished)
        if finished:
            self.stream_output(finished)

    def commit(
        self,
        req: Req,
        token: int | None,
        result: HostBatchResult | None = None,
        row: int = 0,
        hidden: torch.Tensor | None = None,
        check: str = "quick",
    ) -> bool:
        """Commit `token`, sampled for `req` at `result`'s logits row `row`: the one place a sampled
        token joins `req.output_ids` (but for the steps the decode token log held, `commit_logged`;
        the caller commits those first), with its logprobs (as the request asks), the hidden state of its
        input position (`hidden`, decode and verify rows), and the finish check. `check`: "quick" runs
        `check_finished` only where the quick check (`FinishChecker.set_quick_check`) says the token
        may end the request (decode and verify: the prefill's full check set it), "full" always (a
        prefill's first token; a prefill that completes without sampling, `token` None, is checked
        too), "none" never (a PD prefill server's hand-off: the decode server checks it). Returns
        whether `req` finished. What follows a finish or a snapshot (`settle`) is the caller's: a
        verify copies the states first."""
        if hidden is not None:
            add_hidden_states(req, hidden, req.hidden_count)  # (its input token's position)
        if token is not None:
            out = req.output_ids
            out.append(token)
            if result is not None and req.return_logprob and result.next_token_logprobs is not None:
                self._append_output_logprobs(req, result, row, token)
            if check == "quick" and len(out) < req.finish_check_len and token not in req.finish_token_ids:
                return False
        if check != "none":
            self.finisher.check_finished(req)
            if req.grammar is not None and req.grammar.released and req.finished_reason is None:
                self.release_grammar(req)  # (a reasoning grammar whose thinking ended, with nothing after)
        return req.finished_reason is not None

    @staticmethod
    def _append_output_logprobs(req: Req, result: HostBatchResult, i: int, token: int) -> None:
        req.output_token_logprobs.append((result.next_token_logprobs[i], token))
        tops = result.next_token_top_logprobs
        if req.top_logprobs_num and tops is not None and tops[i] is not None:
            req.output_top_logprobs.append(list(zip(*tops[i], strict=True)))
        chosen = result.next_token_ids_logprobs
        if chosen is not None and chosen[i] is not None:
            req.output_token_ids_logprobs.append(list(zip(*chosen[i], strict=True)))

    # ---- finish ------------------------------------------------------------------------------------

    def settle(self, req: Req, pending: tuple[int, int] | None) -> None:
        """After `commit`: commit the decode snapshot the batch wrote for `req` (`pending`: its track
        entry and sequence length), then release `req` if it finished, in that order, so a request that
        finishes on a track boundary inserts the state of that very step (upstream's
        `_handle_finish_state_updated_req`)."""
        if pending is not None:
            self.fast_path.flush(req)  # the tree may take its prefix with the snapshot
            self._mamba_prefix_cache_update(req, *pending)
        if req.finished:
            self.release_finished(req)

    def _mamba_prefix_cache_update(self, req: Req, entry: int, seq_len: int) -> None:
        self.tracker.commit_decode_track(req, entry, seq_len)

    def release_finished(self, req: Req) -> None:
        """Give back what a finished request holds and drop it from the scheduler. One that a batch in
        flight still contains (it finished on the token that batch feeds it, under overlap) leaves the
        scheduler now but gives its KV and slots back when that batch is processed, if the tree then
        takes its final state (`defers_finished_release`): the batch writes that token's KV and state."""
        # The release reads its lists and the client is sent them; the decode set changes (and a batch in
        # flight must not log a token for an aborted request).
        self.fast_path.clear()
        is_insert = not (req.finished_reason and req.finished_reason.get("type") == "abort")
        if is_insert and req.return_routed_experts and self.routed_experts is not None:
            # Every position the model ran (the last output is never fed), read before the slots go back;
            # not for an abort, which may come while a chunk of its prompt is still queued.
            ran = len(req.origin_input_ids) + len(req.output_ids) - 1
            req.routed_experts = self.routed_experts.rows_of(req.kv_indices[:ran])
        if is_insert and req.num_inflight > 0 and self.tree_cache.defers_finished_release(req):
            req.release_deferred = True
            self.deferred_releases.append(req)
        else:
            release_kv_cache(req, self.tree_cache, is_insert=is_insert)
        self.on_release(req)

    def release_landed(self, req: Req) -> None:
        """A deferred release (`release_finished`), once no batch in flight contains the request."""
        if req.release_deferred and req.num_inflight == 0:
            req.release_deferred = False
            self.deferred_releases.remove(req)
            release_kv_cache(req, self.tree_cache, is_insert=True)

    # ---- logprobs ----------------------------------------------------------------------------------

    def _add_input_logprobs(self, req: Req, batch: ScheduleBatch, result, i: int) -> None:
        values = result.input_token_logprobs[i] if i < len(result.input_token_logprobs) else []
        if not req.wants_input_logprobs():
            return
        chosen = result.input_token_ids_logprobs[i] if result.input_token_ids_logprobs else None
        if batch.prepend_none[i]:
            first_id = req.origin_input_ids[0]
            if req.multimodal_inputs is not None:
                first_id = req.multimodal_inputs.shown_ids([first_id])[0]
            req.input_token_logprobs.append((None, first_id))
            if req.top_logprobs_num:
                req.input_top_logprobs.append(None)
            if req.token_ids_logprob:
                req.input_token_ids_logprobs.append(None)
        first = len(req.input_token_logprobs) + max(req.logprob_start_len, 0)
        ids = req.origin_input_ids[first : first + len(values)]
        if req.multimodal_inputs is not None:  # the checkpoint's image / video token, not the pad value
            ids = req.multimodal_inputs.shown_ids(ids)
        req.input_token_logprobs += list(zip(values, ids, strict=True))
        tops = result.input_top_logprobs[i] if result.input_top_logprobs else None
        if req.top_logprobs_num and tops:
            req.input_top_logprobs += [list(zip(*t, strict=True)) for t in tops]
        if chosen:
            req.input_token_ids_logprobs += [list(zip(*t, strict=True)) for t in chosen]

    # ---- output ------------------------------------------------------------------------------------

    def stream_output(self, reqs: list[Req]) -> None:
        """Send each request's new tokens: streaming requests every --stream-interval tokens, all of
        them when they finish."""
        interval = self.stream_interval
        commit_logged(self.token_log)  # what is sent is each request's output_ids
        out = BatchTokenIDOut.empty()
        for req in reqs:
            new = len(req.output_ids) - req.send_offset
            if not (req.finished or (req.stream and new >= interval)):
                continue
            self._append(out, req)
        if out.rids:
            self.output_sink(out)

    def send_finished(self, reqs: list[Req]) -> None:
        commit_logged(self.token_log)  # (an abort outside a step; a release flushed already)
        out = BatchTokenIDOut.empty()
        for req in reqs:
            self._append(out, req)
        if out.rids:
            self.output_sink(out)

    def _append(self, out: BatchTokenIDOut, req: Req) -> None:
        start = req.send_offset
        out.rids.append(req.rid)
        out.finished_reasons.append(req.finished_reason)
        out.output_ids.append(req.output_ids[start:])
        out.prompt_tokens.append(len(req.origin_input_ids))
        out.completion_tokens.append(len(req.output_ids))
        out.cached_tokens.append(req.cached_tokens)
        lp = req.return_logprob
        out.output_token_logprobs.append(req.output_token_logprobs[start:] if lp else None)
        out.output_top_logprobs.append(
            req.output_top_logprobs[start:] if lp and req.top_logprobs_num else None
        )
        first = lp and not req.input_logprobs_sent
        out.input_token_logprobs.append(req.input_token_logprobs if first else None)
        out.input_top_logprobs.append(req.input_top_logprobs if first and req.top_logprobs_num else None)
        ids = lp and req.token_ids_logprob
        out.output_token_ids_logprobs.append(req.output_token_ids_logprobs[start:] if ids else None)
        out.input_token_ids_logprobs.append(req.input_token_ids_logprobs if first and ids else None)
        if req.return_hidden_states:
            unsent, req.hidden_unsent = req.hidden_unsent, []
            out.output_hidden_states.append(torch.cat(unsent) if unsent else None)
        else:
            out.output_hidden_states.append(None)
        out.routed_experts.append(req.routed_experts if req.finished else None)
        out.skip_special_tokens.append(req.sampling_params.skip_special_tokens)
        out.no_stop_trim.append(req.sampling_params.no_stop_trim)
        if self.process_verify is not None:  # speculative decoding: the request's counts
            out.spec_counts.append(list(req.spec_counts or (0,)))
        req.input_logprobs_sent = req.input_logprobs_sent or bool(first)
        req.send_offset = len(req.output_ids)


def commit_logged(log: DecodeTokenLog, req: Req | None = None) -> None:
    """Commit the decode steps `log` holds (for `req` alone, if given): each request's tokens of them join
    its `output_ids` (the one other place, beside `BatchResultProcessor.commit`, where that list grows).
    The log took only steps whose tokens end no request and that want no logprobs, hidden states,
    snapshot or stream: appending them is all that committing them means."""
    for r, tokens in log.take(req):
        r.output_ids.extend(tokens)


def measured_rows(batch: ScheduleBatch) -> Sequence[int]:
    """The rows of a decode or verify `batch` whose checks `FinishChecker.precheck` measures: those its
    decode rows found measured (`DecodeRows.measured_rows`, read once per decode set), or every row of a
    batch built without them (precheck then reads each)."""
    rows = batch.measured_rows
    return range(len(batch.reqs)) if rows is None else rows


def add_hidden_states(req: Req, rows: torch.Tensor, start: int) -> None:
    """`rows`: the hidden states of `req`'s positions from `start` on; those it has already (a retracted
    request's, computed again where its prefix match fell short) are skipped."""
    have = req.hidden_count
    assert start <= have, f"{req}: hidden states from {start}, but it has {have} (a gap)"
    new = rows[have - start :]
    if len(new):
        req.hidden_unsent.append(new)
        req.hidden_count += len(new)
