"""A decode batch's per-request rows (`DecodeRows`: request rows, running slots, sampling and logprob
options), the cache that keeps them while the decode set is unchanged (`DecodeRowsCache`), and each
request's sampling row, which extends read too."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from sglang.srt.constrained.measured import is_measured
from sglang.srt.model_executor.forward_batch_info import SamplingBatchInfo
from sglang.srt.utils.host_tensors import host_int64

if TYPE_CHECKING:
    from sglang.srt.managers.req import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool


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
    # The rows whose finish check is measured (`constrained/measured.is_measured`): what a step's precheck reads.
    measured_rows: tuple[int, ...]
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
        any_grammar = any(r.grammar is not None for r in reqs)
        any_custom_logit = any(r.custom_logit_processor is not None for r in reqs)
        return cls(
            req_pool_indices=rows,
            mamba_pool_indices=slots,
            host_tensors={"req_pool_indices": host_int64(rows), "mamba_pool_indices": host_int64(slots),
                          **lora_host_tensors(reqs)},  # fmt: skip
            sampling_info=info,
            return_logprob_mask=logprob_mask,
            top_logprobs_nums=top_nums,
            token_ids_logprobs=token_ids,
            any_stream=any_stream,
            any_penalized=any_penalized,
            any_grammar=any_grammar,
            any_custom_logit=any_custom_logit,
            measured_rows=tuple(i for i, r in enumerate(reqs) if is_measured(r)),
            hidden_states_mask=hidden_states_mask(reqs),
        )


class DecodeRowsCache:
    """The decode batches' `DecodeRows`, kept while the batch's requests are the same ones in the same
    order (every step, between arrivals and finishes) and no request's row or running slot changed
    (the request pool's `slot_epoch`): building them costs ~0.2 us per request per step. The rows are
    shared by the batches that get them; each batch copies what it may change (`prepare_for_decode`)."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, enabled: bool = True):
        self.pool = req_to_token_pool
        self.enabled = enabled  # False: every decode batch reads its rows anew
        self._reqs: list[Req] = []
        self._epoch = -1
        self._rows: DecodeRows | None = None
        self._uniform_infos: dict = {}  # see `DecodeRows.of`

    def get(self, reqs: list[Req]) -> DecodeRows:
        if not self.enabled:
            return DecodeRows.of(reqs)
        epoch = self.pool.slot_epoch
        # List equality: one C loop over the request objects (compared by identity).
        if self._rows is None or epoch != self._epoch or reqs != self._reqs:
            rows = DecodeRows.of(reqs, self._uniform_infos)
            self._reqs, self._epoch, self._rows = list(reqs), epoch, rows
        return self._rows

    def clear(self) -> None:
        self._reqs, self._rows = [], None


def lora_host_tensors(reqs: Sequence[Req]) -> dict[str, torch.Tensor]:
    """`ForwardBatch.create`'s host tensor `lora_slots`: each request's LoRA slot (-1: the base model);
    none where every request runs the base model."""
    slots = [r.lora_slot for r in reqs]
    return {"lora_slots": host_int64(slots)} if any(s >= 0 for s in slots) else {}


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


def token_ids_logprobs(reqs: list[Req]) -> list[tuple[int, ...] | None] | None:
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
