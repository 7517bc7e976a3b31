"""NGRAM speculative decoding on the scheduler (`--speculative-algorithm NGRAM`): drafts from the
`NgramCache`, the verify batch, and what its result commits.

A verify step takes every decoding request: its newest token and up to D - 1 drafts (D =
--speculative-num-draft-tokens; fewer where its output or context budget ends first) run as one extend,
`ForwardMode.TARGET_VERIFY`, that samples a token at every position with the request's own sampling
options. The token s_t sampled at position t is the one plain decoding would sample after the drafts
before t: the same logits, and seeded sampling hashes the same sequence index (greedy takes the same
argmax). Request i accepts drafts while d_(t+1) == s_t; with a accepted it commits s_0..s_a, cut where
it finishes, and keeps the KV of its newest token and the accepted drafts; the rest goes back. The finish
checks of s_0..s_a that depend on one rank's facts (stop_regex, a charged stop list) are measured before
the commit, all of the step's in one precheck (`FinishChecker.precheck`, `several`: one agreement of the
TP ranks per verify, and the step's output checks' budget shared by all its tokens, which may commit
fewer of them: `FinishChecker.verify_tokens`, decided on the tokens before each, never on its own).

Recurrent state: the forward leaves the state after each position in the pool's verify rows and the
running slot as it was (`MambaPool.verify_row`). The commit copies, as a task on the forward stream
(`ForwardWorker.copy_states`), the state after the last committed token into the running slot and,
where the committed tokens reach a track boundary, the state there into the track slot the build chose
(`MambaTracker.decode_track`); then the slots are as after plain decode steps before the scheduler does
anything else (a finished request hands its running slot to the tree at once: the copy into it is
queued first on the stream, and the rows it reads are not written before the next verify).

Where a CUDA graph serves the verify (`_graph_width`: CUDA graphs on, the batch within the captured
sizes), every request runs the graph's D positions: its drafts, then its newest token again as filler,
whose samples are never accepted; the track boundary and the commit count its real drafts only.

A request whose logits take a penalty at its next position (`penalized_now`) gets no drafts (its token
counts would have to follow them): its one position is penalized as in a decode step; so does a request
with a grammar (its mask would have to follow them), its one position masked, and one with a custom
logit processor (which sees the request's outputs). A request whose
drafts keep being rejected drafts less often (`_backoff`). A step where no request has a draft, or where
the KV pool cannot hold the drafts, decodes plainly.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sglang.srt.constrained.vocab_mask import VocabMaskInfo
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.managers.scheduler_components.batch_result_processor import measured_rows
from sglang.srt.mem_cache.common import alloc_for_verify, release_verify_tail
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.srt.sampling.custom_logit_processor import CustomLogitInfo
from sglang.srt.sampling.penaltylib import PenaltyBatchInfo, counts_tokens
from sglang.srt.speculative.ngram_cache import NgramCache, namespace_seed

if TYPE_CHECKING:
    from sglang.srt.managers.scheduler_components.batch_result_processor import BatchResultProcessor
    from sglang.srt.managers.scheduler_components.decode_rows import DecodeRowsCache
    from sglang.srt.managers.scheduler_components.decode_set import DecodeSetCache
    from sglang.srt.managers.scheduler_components.inflight_batches import InflightBatches
    from sglang.srt.managers.scheduler_components.mamba_tracking import MambaTracker
    from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.decode_kv_log import DecodeKVLog
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.model_executor.forward_worker import HostBatchResult
    from sglang.srt.sampling.penaltylib import PenaltySlots
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

# What a user should know where decode steps replay CUDA graphs and no verify graph could be captured
# (benchmark/gpu/README.md, fifth session, before verify graphs: the 147M Qwen3-Next, bfloat16, 64
# requests, H200).
EAGER_VERIFY_WARNING = (
    "NGRAM verify batches run without CUDA graphs (none could be captured) while plain decode steps "
    "replay theirs: on an H200 a 147M model served 0.17-0.21x of plain decoding's throughput so. It can "
    "pay where a decode step is bound by reading large weights; measure before serving with it."
)


@dataclass
class NgramVerifyInput:
    """A verify batch's drafts, per request: the drafts, the KV length before the verify (its newest
    token sits there), the track slot of a boundary the verify may reach (-1: none; without the
    overlap schedule a request's one track slot, whose snapshot is overwritten only if it is reached),
    and the positions it runs (1 + its drafts, or the batch's fixed width where a CUDA graph serves the
    verify: filler after the drafts, whose samples are never accepted)."""

    drafts: list[list[int]]
    prefix_lens: list[int]
    track_slots: list[int]
    widths: list[int]


@dataclass(frozen=True)
class VerifyCollaborators:
    """What the verify reads and changes of the scheduler, each given explicitly (the worker holds no
    `Scheduler`): the pools and allocators its batches take KV from, the decode fast path's caches a
    verify resets, the result processor its commit goes through, and the few scheduler calls it makes."""

    context_len: int
    # The model runner's `CudaGraphRunner`, or None, as it is now (tests install one after the start).
    graph_runner: Callable[[], Any]
    req_to_token_pool: HybridReqToTokenPool
    token_allocator: PagedTokenAllocator
    tree_cache: BasePrefixCache
    tracker: MambaTracker
    inflight: InflightBatches
    penalty_slots: PenaltySlots
    result_processor: BatchResultProcessor
    decode_set: DecodeSetCache
    rows_cache: DecodeRowsCache
    kv_log: DecodeKVLog
    next_batch_id: Callable[[], int]
    copy_states: Callable[[list[tuple[int, int]]], None]  # the forward stream's state copies
    add_generated: Callable[[int], None]  # the decode log's count of tokens beyond one per step


MAX_BACKOFF = 64  # the most output tokens a request whose drafts keep being rejected goes without drafting


def penalized_now(req: Req) -> bool:
    """Whether `req`'s logits take a penalty at its next position: counts (they would have to follow the
    drafts), a bias, or a ban of its stop ids while it is under min_new_tokens."""
    sp = req.sampling_params
    return req.penalized and (
        counts_tokens(sp) or bool(sp.logit_bias) or sp.min_new_tokens > len(req.output_ids)
    )


class NgramWorker:
    def __init__(self, args: ServerArgs, deps: VerifyCollaborators):
        self.deps = deps
        self.width = args.speculative_num_draft_tokens
        self.cache = NgramCache(
            args.speculative_ngram_min_match_window_size,
            args.speculative_ngram_max_match_window_size,
            args.speculative_ngram_branch_length,
            args.speculative_ngram_capacity,
        )
        # Each running request's tokens (prompt and outputs), as the cache indexes them.
        self._histories: dict[Req, list[int]] = {}
        # Back-off of a request whose drafts keep being rejected: after k verifies in a row that accepted
        # none of its drafts, it drafts again only BACKOFF(k) = min(2^k, 64) tokens later, so its steps
        # decode plainly (cheaper than a verify) where n-grams do not predict its text; an accepted
        # draft ends it. (misses in a row, output length from which it drafts again) per request.
        self._backoff: dict[Req, tuple[int, int]] = {}
        # Totals since start over the requests that had drafts: verify steps (one per such request and
        # verify), drafts proposed and accepted, tokens committed (what /metrics and the decode log read).
        self.stats = {"verify_steps": 0, "draft_tokens": 0, "accepted_tokens": 0, "committed_tokens": 0}
        graphs = deps.graph_runner()
        if graphs is not None and not graphs.verify_max_bs():
            logger.warning(EAGER_VERIFY_WARNING)

    # ---- drafts ------------------------------------------------------------------------------------

    def _history(self, req: Req) -> list[int]:
        """`req`'s tokens, indexed: brought up to date with what it committed since (plain decode
        steps commit too)."""
        tokens = self._histories.get(req)
        if tokens is None:
            tokens = self._histories[req] = list(req.origin_input_ids)
            self.cache.index(tokens, 0, namespace_seed(req.extra_key))
        n, out = len(tokens), req.output_ids
        done = n - len(req.origin_input_ids)  # outputs already in `tokens`
        if done < len(out):
            tokens += out[done:]
            self.cache.index(tokens, n, namespace_seed(req.extra_key))
        return tokens

    def _draft(self, req: Req) -> list[int]:
        """`req`'s drafts: none while its logits take a penalty or it backs off, else as many as its
        output and context budgets leave, up to D - 1. Its text is indexed either way (other requests
        draft from it)."""
        tokens = self._history(req)
        backoff = self._backoff.get(req)
        if (
            penalized_now(req)
            or req.grammar is not None
            or req.return_hidden_states
            or req.custom_logit_processor is not None
        ):
            # (a grammar's mask would have to follow the drafts, as would the outputs a custom logit
            # processor sees; hidden states are taken at one position)
            return []
        if backoff is not None and len(req.output_ids) < backoff[1]:
            return []
        budget = min(
            self.width - 1,
            req.sampling_params.max_new_tokens - len(req.output_ids) - 1,
            self.deps.context_len - req.kv_len - 1,
        )
        return self.cache.draft(tokens, budget, namespace_seed(req.extra_key)) if budget > 0 else []

    def attach(self, batch: ScheduleBatch) -> None:
        """Work on the forward stream beside a launched batch: none (NGRAM drafts on the host)."""

    def cut_short(self, req: Req) -> None:
        """`req`'s verify committed fewer tokens than it accepted (the output checks' budget): nothing to do
        here (NGRAM drafts from the committed text)."""

    def forget(self, req: Req) -> None:
        """`req` left the scheduler (its indexed text stays in the cache)."""
        self._histories.pop(req, None)
        self._backoff.pop(req, None)

    # ---- build -------------------------------------------------------------------------------------

    def get_new_batch_verify(self, reqs: list[Req]) -> ScheduleBatch | None:
        """A verify batch of the decode set `reqs`, or None (the caller decodes them plainly)."""
        deps = self.deps
        if len(reqs) > deps.req_to_token_pool.mamba_pool.verify_shape[0]:
            return None  # more than the running cap (a PD decode server's transfers beside a chunked prefill)
        drafts = [self._draft(r) for r in reqs]
        if not any(drafts):
            return None
        counts = [1 + len(d) for d in drafts]
        allocated = self._allocate_verify(reqs, counts)
        if allocated is None:
            return None
        out_cache_loc, prefix_lens, width = allocated
        batch = ScheduleBatch(reqs, ForwardMode.TARGET_VERIFY, deps.next_batch_id())
        self._prepare(batch, drafts, counts, out_cache_loc, prefix_lens, width)
        return batch

    def _allocate_verify(self, reqs: list[Req], counts: list[int]) -> tuple[Any, list[int], int] | None:
        """The verify's KV slots for `counts` positions per request (out_cache_loc, prefix_lens, and the
        graph width or 0), or None where the pool cannot hold them; the requests leave the decode set."""
        deps = self.deps
        width = self._graph_width(reqs)
        # A CUDA graph's shape (every request runs `width` positions) where the free pages hold it: the
        # filler's KV is given back at the commit, so it never evicts cached prefixes.
        sized = [width] * len(reqs) if width else counts
        allocated = alloc_for_verify(deps.tree_cache, deps.token_allocator, reqs, sized, deps.kv_log)
        if allocated is None:
            return None
        # The decode set's certificates count one token per step: the requests qualify anew.
        for r in reqs:
            r.decode_until = -1
        deps.decode_set.clear()
        return *allocated, width

    def _graph_width(self, reqs: list[Req]) -> int:
        """The positions per request of a verify of `reqs` that a captured CUDA graph serves, or 0 (none
        serves it, a request's context cannot hold that many, or the free KV pages cannot without
        evicting: the verify runs eagerly, unpadded)."""
        deps = self.deps
        graphs = deps.graph_runner()
        if graphs is None or not 0 < len(reqs) <= graphs.verify_max_bs():
            return 0
        width, allocator = graphs.verify_width, deps.token_allocator
        if any(r.kv_len + width > deps.context_len for r in reqs):
            return 0
        pages = sum(allocator.needed_pages(r.kv_len, r.kv_len + width) for r in reqs)
        return width if pages <= allocator.free_pages() else 0

    def _prepare(
        self,
        batch: ScheduleBatch,
        drafts: list[list[int]],
        counts: list[int],
        out_cache_loc: list[int],
        prefix_lens: list[int],
        width: int = 0,
    ) -> None:
        """`counts`: each request's newest token and drafts; `width` (> 0) pads every request to that
        many positions with its newest token (a CUDA graph's shape)."""
        deps, reqs = self.deps, batch.reqs
        tracker, interval = deps.tracker, deps.tracker.interval
        input_ids, writes, track_slots = [], [], []
        widths = [width] * len(reqs) if width else counts
        for i, (req, draft, p) in enumerate(zip(reqs, drafts, prefix_lens, strict=True)):
            input_ids.append(req.output_ids[-1])
            input_ids += draft
            input_ids += [req.output_ids[-1]] * (widths[i] - counts[i])
            if req.req_to_token_dirty_from is not None:
                writes += ScheduleBatch._dirty_row_writes(req, p)
            # The first track boundary among the lengths this verify may reach, p + 1 .. p + count
            # (at most one: --mamba-track-interval >= D).
            boundary = (p // interval + 1) * interval
            track = tracker.decode_track(req, boundary) if boundary <= p + counts[i] else None
            if track is not None:
                batch.pending_tracks[i] = (track[1], boundary)
            track_slots.append(-1 if track is None else track[0])
        batch.sample_rows = [True] * len(reqs)
        batch.completes_prefill = [False] * len(reqs)
        batch.spec_info = NgramVerifyInput(drafts, prefix_lens, track_slots, widths)
        deps.inflight.add(batch)
        batch.future_slots = None  # no overlap: nothing names these tokens before they are processed
        rows = deps.rows_cache.get(reqs)
        batch.any_stream, batch.measured_rows = rows.any_stream, rows.measured_rows

        def per_token(values):
            return [v for v, n in zip(values, widths, strict=True) for _ in range(n)]

        ids = rows.token_ids_logprobs
        batch.forward_batch = ForwardBatch.create(
            ForwardMode.TARGET_VERIFY,
            input_ids=input_ids,
            req_pool_indices=rows.req_pool_indices,
            seq_lens=[p + n for p, n in zip(prefix_lens, widths, strict=True)],
            out_cache_loc=out_cache_loc,
            mamba_pool_indices=rows.mamba_pool_indices,
            extend_prefix_lens=prefix_lens,
            req_to_token_writes=writes,
            sampling_info=rows.sampling_info.repeat_rows(widths),
            return_logprob_mask=per_token(rows.return_logprob_mask),
            top_logprobs_nums=per_token(rows.top_logprobs_nums),
            token_ids_logprobs=None if ids is None else per_token(ids),
            host_tensors=rows.host_tensors,
        )
        batch.forward_batch.verify_width = width
        batch.forward_batch.return_hidden_states_mask = rows.hidden_states_mask  # (at first positions)
        first = list(itertools.accumulate(widths, initial=0))[:-1]  # each request's first logits row
        if any(r.penalized for r in reqs):
            # The penalties apply at each request's first position, as in a decode step of its newest token.
            first_lens = [p + 1 for p in prefix_lens]
            info = PenaltyBatchInfo.build(reqs, first_lens, batch.sample_rows, deps.penalty_slots)
            if info is not None:  # (None: every penalty is spent, e.g. a min_new_tokens reached)
                batch.forward_batch.penalties = info.at_logit_rows(first)
        if any(r.grammar is not None for r in reqs):
            # So does a grammar's mask (its request has no drafts: one real position).
            mask = VocabMaskInfo.build(reqs, batch.sample_rows)
            batch.forward_batch.vocab_mask = mask.at_logit_rows(first)
        if any(r.custom_logit_processor is not None for r in reqs):  # (no drafts there either)
            processors = CustomLogitInfo.build(reqs, batch.sample_rows)
            batch.forward_batch.custom_logit = processors.at_logit_rows(first)
        batch.state_copies = deps.tree_cache.take_pending_state_copies()
        # A host tier's copies recorded so far run before the verify, as before any batch: a backup of
        # pages the verify's allocation evicted reads them before the verify writes them.
        batch.host_copies = deps.tree_cache.take_host_copies()

    def internal_state(self) -> dict:
        """For /get_server_info: upstream's `avg_spec_accept_length` (tokens committed per request and
        verify since start, over the requests that had drafts) and the totals behind it."""
        steps = self.stats["verify_steps"]
        avg = self.stats["committed_tokens"] / steps if steps else 0.0
        return {"avg_spec_accept_length": avg, "speculative": dict(self.stats)}

    # ---- commit ------------------------------------------------------------------------------------

    def process_batch_result_verify(self, batch: ScheduleBatch, result: HostBatchResult) -> None:
        deps = self.deps
        rp, pool = deps.result_processor, deps.req_to_token_pool.mamba_pool
        # Tokens committed here are outside the decode token log's count of steps: it forgets its run
        # (appending what it holds) and starts anew after the next plain steps.
        rp.token_log.clear()
        spec: NgramVerifyInput = batch.spec_info
        sampled_all, hidden = result.next_token_ids, result.hidden_states
        firsts = list(itertools.accumulate(spec.widths, initial=0))  # each request's first logits row
        # Request i accepts its drafts while each equals the token sampled before it: it commits those
        # and the token sampled after the last (cut where a check ends it).
        accepts = []
        for drafts, at in zip(spec.drafts, firsts, strict=False):
            accepted = 0
            while accepted < len(drafts) and sampled_all[at + accepted] == drafts[accepted]:
                accepted += 1
            accepts.append(accepted)
        commits = [a + 1 for a in accepts]  # the tokens each may commit
        measured = measured_rows(batch)
        if measured:  # (a decode set without grammars, stop_regex or processors: no scan)
            # Every token each measured request may commit, checked in one agreement (`_precheck_tokens`);
            # the budget may leave some tokens after the first (`verify_tokens`): sampled again at the
            # next step, as after a rejected draft.
            finisher = rp.finisher
            rows = [(batch.reqs[i], sampled_all[firsts[i] : firsts[i] + commits[i]]) for i in measured]
            finisher.precheck(rows, several=True)
            for i in measured:
                n = finisher.verify_tokens(batch.reqs[i])
                if n is not None and n < commits[i]:
                    commits[i] = n
                    self.cut_short(batch.reqs[i])
        touched: list[Req] = []
        copies: list[tuple[int, int]] = []  # (verify row, slot): the states the commit keeps
        settled: list[tuple[Req, tuple[int, int] | None]] = []  # to release or commit a snapshot for
        committed_total = accepted_total = drafted_rows = drafted_committed = 0
        for i, req in enumerate(batch.reqs):
            drafts, p, at, accepted = spec.drafts[i], spec.prefix_lens[i], firsts[i], accepts[i]
            if req.finished_reason is not None:
                rp.release_landed(req)
                continue
            sampled = sampled_all[at : at + commits[i]]
            # (hidden states: a request that returns them has no drafts, so its first position only)
            committed = 0
            for t in range(commits[i]):
                committed += 1
                row_hidden = hidden[i] if hidden is not None and t == 0 else None
                if rp.commit(req, sampled[t], result, at + t, row_hidden):
                    break
            committed_total += committed
            accepted_total += committed - 1
            counts = req.spec_counts
            if counts is None:
                counts = req.spec_counts = [0]
            counts[0] += len(drafts)
            if committed > 1:  # (a verify that accepted none counts as any decode step: see meta_info)
                counts.extend([0] * (committed - len(counts)))
                counts[committed - 1] += 1
            if drafts:
                drafted_rows += 1
                drafted_committed += committed
                if accepted:
                    self._backoff.pop(req, None)
                else:
                    misses = self._backoff.get(req, (0, 0))[0] + 1
                    self._backoff[req] = (misses, len(req.output_ids) + min(2**misses, MAX_BACKOFF))
            # The request keeps the KV of p + committed positions; its state after them is the verify row
            # of its last committed token, and a track boundary they reach takes the state there.
            release_verify_tail(deps.token_allocator, req, p + committed)
            copies.append((pool.verify_row(i, committed - 1), req.mamba_pool_idx))
            pending = batch.pending_tracks.get(i)
            if pending is not None and pending[1] <= p + committed:
                copies.append((pool.verify_row(i, pending[1] - p - 1), spec.track_slots[i]))
            else:
                pending = None  # not reached: nothing was written, the newest snapshot stands
            if pending is not None or req.finished_reason is not None:
                settled.append((req, pending))
            if req.stream or req.finished_reason is not None:
                touched.append(req)
        # The states go where they belong now, before any slot is given back or handed over: with the radix
        # cache off a finished request's running slot returns to the free list, and a PD transfer may write
        # it before the next batch (`copy_states` returns once the copies are on the forward stream).
        deps.copy_states(copies)
        for req, pending in settled:
            rp.settle(req, pending)
        rp.counters["num_generation_tokens_total"] += committed_total
        deps.add_generated(committed_total - len(batch.reqs))
        stats = self.stats
        stats["verify_steps"] += drafted_rows  # (a row without drafts verifies nothing)
        stats["draft_tokens"] += sum(map(len, spec.drafts))
        stats["accepted_tokens"] += accepted_total
        stats["committed_tokens"] += drafted_committed
        rp.stream_output(touched)
