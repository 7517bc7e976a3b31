"""EAGLE / NEXTN speculative decoding on the scheduler (`--speculative-algorithm EAGLE` or `NEXTN`, the
same here: drafts of the checkpoint's own MTP layer, `models/qwen3_next_mtp.py`, one chain, topk 1).

A step of the decoding requests is NGRAM's verify (`ngram_worker.py`: one extend of each request's newest
token and its drafts, per-position recurrent states, the commit through `BatchResultProcessor.commit`
and the state copies) with drafts from the MTP layer instead of an n-gram cache:

1. The verify's KV slots are allocated first (k + 1 = --speculative-num-draft-tokens positions per
   drafting request), so that the draft steps can write the MTP layer's KV into those of positions
   P .. P + k - 2 (P: the request's newest token).
2. `MtpDraftRunner.draft_steps` runs on the forward stream: draft d_1 is drawn from the MTP output the
   previous forward left (`mtp_draft.DraftStash`), steps 2..k run the MTP layer; the drafts come back to
   the host.
3. The verify batch is built as NGRAM's, with `MtpHook` on it: rejection sampling for sampling requests
   (against their drafts' distributions, or q = one-hot(draft) where the drafts are greedy: `Drafts`),
   and the MTP layer over the verify's positions with the tokens the verify committed, which leaves the
   next step's d_1. Every other target forward (prefill chunks, plain decode steps) gets the hook too
   (`attach`), so the MTP layer's KV covers every committed position.

A request drafts when it may take k more tokens (its output and context budgets) and its logits take no
penalty, grammar or custom processor (as NGRAM's `_draft`), and not at the step after a verify that
committed fewer tokens than it accepted (`cut_short`); the others verify their newest token alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.mtp_draft import DraftPlan, MtpDraftRunner, MtpHook
from sglang.srt.speculative.ngram_worker import NgramWorker, VerifyCollaborators, penalized_now

if TYPE_CHECKING:
    from collections.abc import Callable

    from sglang.srt.server_args import ServerArgs


class EagleWorker(NgramWorker):
    """NGRAM's verify and commit (`NgramWorker`), drafts from the MTP layer."""

    def __init__(
        self,
        args: ServerArgs,
        deps: VerifyCollaborators,
        draft: MtpDraftRunner,
        run_on_stream: Callable[[Callable[[], Any]], Any],
    ):
        self.deps = deps
        self.width = args.speculative_num_draft_tokens
        self.steps = args.speculative_num_steps
        self.draft = draft
        self.run_on_stream = run_on_stream
        self._backoff: dict[Req, tuple[int, int]] = {}  # (NGRAM's; MTP drafts never back off)
        self._restash: set[Req] = set()  # (`cut_short`)
        self.stats = {"verify_steps": 0, "draft_tokens": 0, "accepted_tokens": 0, "committed_tokens": 0}

    def forget(self, req: Req) -> None:
        self._backoff.pop(req, None)
        self._restash.discard(req)

    def cut_short(self, req: Req) -> None:
        """`req`'s verify committed fewer tokens than it accepted (`FinishChecker.verify_tokens`): the MTP
        output the verify stashed for its next d_1 is the one after the last accepted position, computed
        from tokens that were not committed (for a seeded sampling request, functions of the uniforms the
        next verify draws again at those positions). It drafts nothing at its next step: its one-position
        row stashes the MTP output after its newest committed token (`MtpHook._verify`)."""
        self._restash.add(req)

    def _drafts_for(self, req: Req) -> bool:
        if req in self._restash:
            self._restash.discard(req)
            return False
        if (
            penalized_now(req)
            or req.grammar is not None
            or req.return_hidden_states
            or req.custom_logit_processor is not None
        ):
            return False
        left = min(
            req.sampling_params.max_new_tokens - len(req.output_ids) - 1,
            self.deps.context_len - req.kv_len - 1,
        )
        return left >= self.steps

    # ---- every target forward ----------------------------------------------------------------------

    def attach(self, batch: ScheduleBatch) -> None:
        """The MTP hook of a prefill or plain decode batch (a verify has its own)."""
        fb = batch.forward_batch
        if fb is None or fb.spec is not None or fb.batch_size == 0:
            return
        hook = MtpHook(self.draft)
        if batch.forward_mode == ForwardMode.EXTEND:
            next_ids: list[int] = []
            for req, p, n in zip(batch.reqs, fb.extend_prefix_lens_cpu, fb.extend_seq_lens_cpu, strict=True):
                end = p + n
                following = req.fill_ids[p + 1 : end + 1]
                next_ids += following + [-1] * (n - len(following))
            hook.next_ids = next_ids
            hook.completes = list(batch.completes_prefill)
        fb.spec = hook

    # ---- build -------------------------------------------------------------------------------------

    def get_new_batch_verify(self, reqs: list[Req]) -> ScheduleBatch | None:
        deps = self.deps
        if len(reqs) > deps.req_to_token_pool.mamba_pool.verify_shape[0]:
            return None
        drafting = [self._drafts_for(r) for r in reqs]
        if not any(drafting):
            return None
        counts = [self.width if d else 1 for d in drafting]
        allocated = self._allocate_verify(reqs, counts)
        if allocated is None:
            return None
        out_cache_loc, prefix_lens, width = allocated
        rows = deps.rows_cache.get(reqs)
        picked = [i for i, d in enumerate(drafting) if d]
        plan = DraftPlan(
            rows=[reqs[i].req_pool_idx for i in picked],
            prefix_lens=[prefix_lens[i] for i in picked],
            slots=[reqs[i].kv_indices[prefix_lens[i] : prefix_lens[i] + self.steps] for i in picked],
            writes=[w for i in picked for w in ScheduleBatch._dirty_row_writes(reqs[i], prefix_lens[i])],
            sampling_info=rows.sampling_info.repeat_rows([int(d) for d in drafting]),
            steps=self.steps,
        )
        # A host tier's copies recorded up to the allocation (backups of pages it evicted) run before the
        # draft steps write the MTP layer's KV into those pages.
        host_copies = deps.tree_cache.take_host_copies()

        def draft_steps():
            if host_copies:
                deps.tree_cache.run_host_copies(host_copies)
            return self.draft.draft_steps(plan)

        drafted = self.run_on_stream(draft_steps)
        drafts: list[list[int]] = [[] for _ in reqs]
        for i, chain in zip(picked, drafted.chains, strict=True):
            drafts[i] = chain
        batch = ScheduleBatch(reqs, ForwardMode.TARGET_VERIFY, deps.next_batch_id())
        self._prepare(batch, drafts, counts, out_cache_loc, prefix_lens, width)
        batch.forward_batch.spec = MtpHook(
            self.draft,
            widths=batch.spec_info.widths,
            num_drafts=[len(d) for d in drafts],
            drafts=drafted,
        )
        return batch
