"""A batch's grammar masks (upstream's `vocab_mask`): for each row of a request with a grammar, the tokens
its grammar allows next, as bits (xgrammar's layout: bit j of int32 word w is token 32 w + j). Built on
the host when the batch is built (`VocabMaskInfo.build`: every matcher has seen every token its request
committed, see `Scheduler`'s overlap rule), moved with the batch in its one transfer, and applied to the
logits after the penalties and before temperature, top-k/top-p and the logprobs (`apply_vocab_mask`):
a banned token gets -inf, so it is never sampled and its logprob is -inf."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from sglang.srt.constrained.xgrammar_backend import GrammarRejectedToken
from sglang.srt.utils.host_tensors import host_int64

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

BITS = 32


@dataclass
class VocabMaskInfo:
    rows: torch.Tensor  # [G] int64: the batch rows (logits rows) that have a grammar
    bitmask: torch.Tensor  # [G, ceil(vocab / 32)] int32

    TENSOR_FIELDS = ("rows", "bitmask")

    @classmethod
    def build(cls, reqs: Sequence[Req], sample_rows: Sequence[bool]) -> VocabMaskInfo | None:
        """The masks of the rows of `reqs` that sample with a grammar (None if there is none). Each
        request's matcher first accepts the outputs it has not seen (`RequestGrammar.catch_up`); one
        that rejects one gets no mask here, and its finish check ends it with the error."""
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and sample_rows[i]]
        if not rows:
            return None
        vocab_size = reqs[rows[0]].grammar.vocab_size
        bitmask = torch.full((len(rows), -(-vocab_size // BITS)), -1, dtype=torch.int32)
        for k, i in enumerate(rows):
            grammar = reqs[i].grammar
            try:
                grammar.catch_up(reqs[i].output_ids)
            except GrammarRejectedToken:
                continue
            grammar.fill(bitmask, k)
        return cls(host_int64(rows), bitmask)

    def at_logit_rows(self, logit_rows: Sequence[int]) -> VocabMaskInfo:
        """The same masks where request i's logits are row `logit_rows[i]` (a speculative verify, whose
        requests with a grammar have one position each); host tensors, before the batch moves."""
        return replace(self, rows=host_int64(logit_rows).index_select(0, self.rows))


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[G, vocab] bool from the bits."""
    shifts = torch.arange(BITS, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # an arithmetic shift: bit 31 reads right too
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_vocab_mask(logits: torch.Tensor, info: VocabMaskInfo) -> torch.Tensor:
    """`logits` [bs, vocab] with each masked row's banned tokens at -inf, in place. Where the penalties
    had already banned every token the grammar allows (min_new_tokens banning the end-of-sequence id a
    complete grammar needs), the grammar wins: its tokens become equally likely (a sampler given only
    -inf would return NaN logprobs and a token the grammar refuses). No host sync: a `where` on the
    device."""
    allowed = allowed_tokens(info.bitmask, logits.shape[1])
    masked = logits[info.rows].masked_fill(~allowed, float("-inf"))
    dead = torch.isneginf(masked).all(dim=-1, keepdim=True)
    logits[info.rows] = torch.where(dead & allowed, torch.zeros_like(masked), masked)
    return logits
