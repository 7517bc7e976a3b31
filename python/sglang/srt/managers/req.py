"""`Req`: one request's scheduling state (SGLang's field names; `schedule_batch` re-exports it under
upstream's import path).

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
  mamba_extra_snapshots         (slot, position) of snapshots in slots borrowed for them until the tree
                                takes them over (prefill ones beyond the primary; under lazy, all)

Overlap: a request's newest sampled token may still be in flight (`inflight_tokens` > 0); a decode
batch then names it by a placeholder (-(future slot + 1)) that the forward stream resolves. What is in
flight for a request is the scheduler's `InflightBatches` (`Req.inflight`), not counted on the request.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sglang.srt.sampling.custom_logit_processor import CustomLogitProcessor
from sglang.srt.sampling.penaltylib import is_penalized
from sglang.srt.sampling.sampling_params import SamplingParams

if TYPE_CHECKING:
    from sglang.srt.constrained.xgrammar_backend import RequestGrammar
    from sglang.srt.managers.io_struct import BootstrapInfo


class InflightCounts(Protocol):
    """What a request asks of the scheduler's `InflightBatches` (structural: it reads `Req` from here)."""

    def num_inflight(self, req: Req) -> int: ...

    def inflight_tokens(self, req: Req) -> int: ...


class Req:
    # Slots, not a __dict__: the scheduler touches a few of these per request at every step, and a
    # compact object keeps them in fewer cache lines (the forward runs on the same core on CPU).
    __slots__ = (
        "rid",
        "origin_input_ids",
        "multimodal_inputs",
        "output_ids",
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
        "kv_indices",
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
        "lora_id",
        "lora_slot",
        "grammar",
        "require_reasoning",
        "return_hidden_states",
        "return_routed_experts",
        "routed_experts",
        "custom_logit_processor",
        "custom_logit_error",
        "custom_logit_state",
        "priority",
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
        self.multimodal_inputs: Any = None  # its images (`multimodal.inputs.MultimodalInputs`), or None
        # The tokens sampled so far. Only `BatchResultProcessor`'s commit path appends to it; while the
        # request decodes, the newest steps' tokens may wait in the scheduler's `DecodeFastPath`, which
        # appends them at every boundary where the list is read (scheduler_components/decode_fast_path.py).
        self.output_ids: list[int] = []
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
        self.inflight: InflightCounts | None = None
        self.decode_until = -1  # the scheduler's decode selection certificate (`DecodeSetCache`)
        self.release_deferred = False  # finished; releases when no batch in flight contains it

        # KV and radix cache
        self.req_pool_idx: int | None = None
        # The KV slot of each position scheduled so far (as `output_ids`: the newest decode steps' slots
        # may wait in the `DecodeFastPath` until a boundary that reads the list).
        self.kv_indices: list[int] = []
        self.cache_protected_len = 0
        self.last_node: Any = None
        self.req_to_token_dirty_from: int | None = None
        self.cached_tokens = 0
        self.admitted_once = False
        # The prefix-cache namespace (upstream's `cache_salt + extra_key`): the radix tree matches and
        # inserts this request's tokens among those of its namespace only; None: the shared one.
        self.extra_key: str | None = None
        # LoRA: the adapter's id (None: the base model), and its device slot while running (-1: none).
        self.lora_id: str | None = None
        self.lora_slot = -1

        # Mamba state
        self.mamba_pool_idx: int | None = None
        self.mamba_ping_pong_track_buffer: list[int] | None = None
        self.mamba_next_track_idx = 0
        self.mamba_last_track_seqlen: int | None = None
        self.mamba_branching_seqlen: int | None = None
        self.mamba_cow_src_index: int | None = None
        self.mamba_needs_clear = False
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
        # Its answer starts inside the model's reasoning (upstream's require_reasoning): a grammar applies
        # after it (constrained/reasoning_grammar.py).
        self.require_reasoning = False
        # return_hidden_states: how many positions' final hidden states it has, from 0 on (a retracted
        # request recomputes none of them: admission matches its prefix up to there), and the rows not
        # sent yet (tensors [n, hidden] on the host; the scheduler keeps none after sending them).
        self.return_hidden_states = False
        # return_routed_experts: its positions' routing [n, layers, k], read when it finishes (model_executor/
        # routed_experts.py), sent with its last message.
        self.return_routed_experts = False
        self.routed_experts: torch.Tensor | None = None
        # --enable-custom-logit-processor: the processor its logits go through (sampling/
        # custom_logit_processor.py), and why it failed if it raised (the finish check ends it then).
        self.custom_logit_processor: CustomLogitProcessor | None = None
        self.custom_logit_error: str | None = None
        self.custom_logit_state: Any = None  # the processor's own, kept across steps (e.g. a scan)
        self.hidden_count = 0
        self.hidden_unsent: list[torch.Tensor] = []
        # --enable-priority-scheduling: its place among the waiting requests (`priority_scheduling.py`).
        self.priority: int | None = None

    # ---- derived -----------------------------------------------------------------------------------

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

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

    def __repr__(self) -> str:
        return f"Req(rid={self.rid!r}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"
