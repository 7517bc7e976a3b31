"""Logit penalties (upstream's `penaltylib`): frequency, presence and repetition penalties over a request's
output tokens, `min_new_tokens` (its stop tokens banned until that many tokens are out) and `logit_bias`.

Upstream's rules, applied to a request's next-token logits before temperature, top-k/top-p and the
logprobs (which then include them), in this order:
- repetition penalty p, over every token id the request has sampled so far: a logit l becomes l / p
  where l > 0, else l * p;
- frequency penalty f and presence penalty r: l - f * count(id) - r * (count(id) > 0);
- logit_bias: l + bias[id];
- min_new_tokens m: while fewer than m tokens are out, the ids that would stop the request (its
  stop_token_ids, and EOS unless ignore_eos) get -inf.

Who owns what:
- `PenaltySlots` (the scheduler, host ints): a request with a count-based penalty takes a row of the
  counts at its first batch and keeps it, across retraction, until it leaves the scheduler.
- `PenaltyBatchInfo` (built on the host with each batch that has a penalized request, moved with it in
  the batch's one transfer): which batch rows read which count rows with which penalties, the rows to
  zero first (a row taken by a new request), the bans and the biases.
- `Penalizer` (the model runner, on the model's device): the counts [rows, vocab] int32, grown on
  demand, and the two steps of a forward: `apply` to the logits, then `cumulate` the sampled ids.

Under overlap the scheduler does not know a batch's sampled tokens when it builds the next one, so the
counts live on the forward stream and are updated there from the sampled ids (no host trip). The order
of the stream is what keeps them right: a row a finished request gave back is zeroed by the first batch
of its next owner, which runs after every batch of the previous one. The bans are decided on the host:
how many tokens a request has out at a batch is known there (its sequence length), in flight or not.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

from sglang.srt.utils.host_tensors import host_float32, host_int64

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams


def is_penalized(sp: SamplingParams) -> bool:
    """Whether a request's logits need `Penalizer.apply` (decided once per request)."""
    return bool(counts_tokens(sp) or sp.min_new_tokens > 0 or sp.logit_bias)


def counts_tokens(sp: SamplingParams) -> bool:
    """Whether a request's penalties read its output token counts (it then takes a `PenaltySlots` row)."""
    return sp.frequency_penalty != 0 or sp.presence_penalty != 0 or sp.repetition_penalty != 1


class PenaltySlots:
    """Rows of the `Penalizer`'s counts, handed out lowest first (so the counts stay as small as the
    most penalized requests ever running at once)."""

    def __init__(self) -> None:
        self._free: list[int] = []  # a heap
        self._next = 0  # rows from here on were never handed out
        self.in_use: set[int] = set()

    @property
    def size(self) -> int:
        """How many rows were ever handed out (the counts need at least this many)."""
        return self._next

    def alloc(self) -> int:
        slot = heapq.heappop(self._free) if self._free else self._next
        if slot == self._next:
            self._next += 1
        self.in_use.add(slot)
        return slot

    def free(self, slot: int) -> None:
        self.in_use.remove(slot)
        heapq.heappush(self._free, slot)

    def check(self, holders: Sequence[Req]) -> None:
        """Every row in use is held by exactly one live request, and each such request holds one."""
        held = [r.penalty_slot for r in holders if r.penalty_slot is not None]
        assert len(held) == len(set(held)), "two requests hold the same penalty row"
        assert set(held) == self.in_use, f"penalty rows in use {sorted(self.in_use)}, held {sorted(held)}"


@dataclass
class PenaltyBatchInfo:
    """One batch's penalties (see the module docstring); every tensor is on the host until the batch
    moves. Count rows: `rows[j]` of the batch reads count row `slots[j]` with its penalties; the sampled
    ids of the batch rows `count_rows` (those that sample a token the request keeps: an extend chunk
    that does not finish its prompt samples nothing) are added to `count_slots`."""

    rows: torch.Tensor | None = None  # [P] int64 batch rows with count-based penalties
    slots: torch.Tensor | None = None  # [P] int64 their count rows
    frequency: torch.Tensor | None = None  # [P] float32
    presence: torch.Tensor | None = None  # [P] float32
    repetition: torch.Tensor | None = None  # [P] float32
    count_rows: torch.Tensor | None = None  # [Q] int64
    count_slots: torch.Tensor | None = None  # [Q] int64
    clear_slots: torch.Tensor | None = None  # count rows to zero before anything reads them
    # Tokens a request had out before it took its row (a PD decode server's first token): counted
    # once, after the clear.
    init_slots: torch.Tensor | None = None
    init_ids: torch.Tensor | None = None
    ban_rows: torch.Tensor | None = None  # (batch row, token id) pairs set to -inf
    ban_ids: torch.Tensor | None = None
    bias_rows: torch.Tensor | None = None  # (batch row, token id) pairs and their bias
    bias_ids: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    num_slots: int = 0  # one past the largest count row the batch names (the counts grow to it)

    TENSOR_FIELDS = (
        "rows", "slots", "frequency", "presence", "repetition", "count_rows", "count_slots", "clear_slots",
        "init_slots", "init_ids", "ban_rows", "ban_ids", "bias_rows", "bias_ids", "bias_values",
    )  # fmt: skip
    ROW_FIELDS = ("rows", "count_rows", "ban_rows", "bias_rows")  # batch rows (the logits' rows)

    def at_logit_rows(self, logit_rows: Sequence[int]) -> PenaltyBatchInfo:
        """The same penalties where request i's logits are row `logit_rows[i]` (a speculative verify,
        whose penalized requests each have one position); host tensors, before the batch moves."""
        where = host_int64(logit_rows)
        moved = {
            name: where.index_select(0, t) for name in self.ROW_FIELDS if (t := getattr(self, name)) is not None
        }
        return replace(self, **moved)

    @classmethod
    def build(
        cls, reqs: Sequence[Req], seq_lens: Sequence[int], sample_rows: Sequence[bool], slots: PenaltySlots
    ) -> PenaltyBatchInfo | None:
        """The info of a batch of `reqs` (None when no request of it is penalized). `seq_lens[i]`: request
        i's length after this forward, so it has `seq_lens[i] - len(prompt)` tokens out when it samples
        here; `sample_rows[i]`: whether row i samples a token the request keeps. A request with a
        count-based penalty and no row takes one here."""
        # Tuples per entry, turned into the fields' columns below.
        counted: list[tuple[int, int, float, float, float]] = []  # (row, slot, freq, presence, repetition)
        kept: list[tuple[int, int]] = []  # (row, slot) of the rows whose sampled token counts
        clear: list[int] = []
        init: list[tuple[int, int]] = []  # (slot, token)
        bans: list[tuple[int, int]] = []  # (row, token)
        biases: list[tuple[int, int, float]] = []  # (row, token, bias)
        for i, req in enumerate(reqs):
            if not req.penalized:
                continue
            sp = req.sampling_params
            if counts_tokens(sp):
                slot = req.penalty_slot
                if slot is None:
                    slot = req.penalty_slot = slots.alloc()
                    clear.append(slot)
                    init += [(slot, t) for t in req.output_ids]
                counted.append((i, slot, sp.frequency_penalty, sp.presence_penalty, sp.repetition_penalty))
                if sample_rows[i]:
                    kept.append((i, slot))
            if sp.min_new_tokens > seq_lens[i] - len(req.origin_input_ids):
                stops = req.finish_token_ids if req.finish_token_ids is not None else sp.stop_token_ids
                bans += [(i, t) for t in stops]
            if sp.logit_bias:
                biases += [(i, t, b) for t, b in sp.logit_bias.items()]
        if not (counted or bans or biases):
            return None
        rows, row_slots, freq, pres, rep = _columns(counted, "iifff")
        count_rows, count_slots = _columns(kept, "ii")
        init_slots, init_ids = _columns(init, "ii")
        ban_rows, ban_ids = _columns(bans, "ii")
        bias_rows, bias_ids, bias_values = _columns(biases, "iif")
        return cls(
            rows=rows, slots=row_slots, frequency=freq, presence=pres, repetition=rep, count_rows=count_rows,
            count_slots=count_slots, clear_slots=host_int64(clear) if clear else None, init_slots=init_slots,
            init_ids=init_ids, ban_rows=ban_rows, ban_ids=ban_ids, bias_rows=bias_rows, bias_ids=bias_ids,
            bias_values=bias_values, num_slots=max((c[1] for c in counted), default=-1) + 1,
        )  # fmt: skip


assert {f.name for f in fields(PenaltyBatchInfo)} >= set(PenaltyBatchInfo.TENSOR_FIELDS)


class Penalizer:
    """The output token counts of the penalized requests and the two steps of a forward (upstream's
    `BatchedPenalizerOrchestrator`: `apply`, then `cumulate_output_tokens`). Runs on the forward stream;
    reads nothing back from the device."""

    def __init__(self) -> None:
        self.counts: torch.Tensor | None = None  # [rows, vocab] int32

    def _ensure(self, info: PenaltyBatchInfo, vocab: int, device: torch.device) -> torch.Tensor:
        counts = self.counts
        if counts is None or counts.shape[0] < info.num_slots:
            rows = max(info.num_slots, 2 * (0 if counts is None else counts.shape[0]), 8)
            grown = torch.zeros(rows, vocab, dtype=torch.int32, device=device)
            if counts is not None:
                grown[: counts.shape[0]] = counts
            counts = self.counts = grown
        if info.clear_slots is not None:
            counts[info.clear_slots] = 0
        if info.init_slots is not None:
            counts.index_put_((info.init_slots, info.init_ids), _ones(info.init_ids), accumulate=True)
        return counts

    def apply(self, logits: torch.Tensor, info: PenaltyBatchInfo) -> torch.Tensor:
        """`logits` [bs, vocab] with the batch's penalties applied: float32 (a copy of lower-precision
        logits; float32 ones are changed in place)."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        if info.rows is not None:
            counts = self._ensure(info, logits.shape[1], logits.device)[info.slots]
            seen = counts > 0
            sub = logits[info.rows]
            rep = info.repetition[:, None]
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
            sub = sub - info.frequency[:, None] * counts - info.presence[:, None] * seen
            logits[info.rows] = sub
        if info.bias_rows is not None:
            logits.index_put_((info.bias_rows, info.bias_ids), info.bias_values, accumulate=True)
        if info.ban_rows is not None:
            logits[info.ban_rows, info.ban_ids] = float("-inf")
        return logits

    def cumulate(self, info: PenaltyBatchInfo, next_token_ids: torch.Tensor) -> None:
        """Count each sampled id of the rows that keep their token."""
        if info.count_rows is not None:
            ids = next_token_ids[info.count_rows]
            self.counts.index_put_((info.count_slots, ids), _ones(ids), accumulate=True)


def _columns(entries: list[tuple], kinds: str) -> list[torch.Tensor | None]:
    """The host tensors of `entries`' columns (`kinds`: i int64, f float32), or Nones when empty."""
    if not entries:
        return [None] * len(kinds)
    return [
        host_int64(col) if kind == "i" else host_float32(col)
        for col, kind in zip(zip(*entries, strict=True), kinds, strict=True)
    ]


def _ones(like: torch.Tensor) -> torch.Tensor:
    return torch.ones(like.shape, dtype=torch.int32, device=like.device)
