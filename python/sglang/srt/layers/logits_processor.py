"""Logits only where they are needed, and input-token logprobs.

Rows computed: the last token of every request (its logits pick the next token) and, for requests
that return logprobs in an extend, the rows their input logprobs need; every token of a speculative
verify.

Input logprobs (extend, request i with return_logprob_mask[i], start = extend_logprob_start_lens_cpu[i],
E = its extend length): one value per extend offset j with start < j < E, the logprob of input token j
computed from the logits at offset j - 1; then, if `extend_logprob_next_ids_cpu[i]` is given (the first
token of the next prefill chunk), its logprob from the logits at offset E - 1. All logprobs are
log_softmax of the logits divided by the request's temperature (the raw logits when it is greedy),
before any top-p / top-k cut, as SGLang returns them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sglang.srt.environ import envs
from sglang.srt.utils.host_tensors import move_to_device

if TYPE_CHECKING:
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

TopLogprobs = tuple[list[float], list[int]]


@dataclass
class LogitsProcessorOutput:
    # [bs, vocab] in the lm_head's dtype: the sampler casts to float32 where it computes more than an
    # argmax (a greedy step without logprobs does not: bfloat16 logits at batch 256 x 151,936 are 78 MB,
    # their float32 copy 156 MB more to write and read again).
    next_token_logits: torch.Tensor
    input_token_logprobs: list[list[float]] | None = None
    input_top_logprobs: list[list[TopLogprobs]] | None = None
    input_token_ids_logprobs: list[list[TopLogprobs]] | None = None
    # With `fb.return_hidden_states_mask`: the hidden states (the lm_head's input) of the positions the
    # requests that return them ran (`HiddenRows`).
    hidden_states: HiddenRows | None = None


@dataclass
class HiddenRows:
    """`rows` [R, hidden] float32, on the model's device until the result's copy to the host; `spans[i]`,
    request i's (first row, count) in it, or None for a request that does not return them."""

    rows: torch.Tensor
    spans: list[tuple[int, int] | None]

    def per_request(self) -> list[torch.Tensor | None]:
        """Each request's rows (views of `rows`), or None."""
        return [None if s is None else self.rows[s[0] : s[0] + s[1]] for s in self.spans]


def rows_as_lists(rows: torch.Tensor) -> list[list[float]]:
    """Host rows as JSON's lists (the HTTP process makes each once; a host tensor: no device sync)."""
    assert rows.device.type == "cpu", "rows come to the host with the step's results"
    return rows.tolist()


def scaled_log_softmax(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / T) per row; T <= 0 (greedy) leaves the row unscaled."""
    t = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    return torch.log_softmax(logits.float() / t[:, None], dim=-1)


def top_logprobs(logprobs: torch.Tensor, nums: list[int]) -> list[TopLogprobs | None]:
    """Row i's `nums[i]` largest logprobs (None where 0): one topk over the rows that want some and one
    copy to the host (a call and a copy per row add up to milliseconds at hundreds of rows)."""
    rows = [i for i, n in enumerate(nums) if n > 0]
    out: list[TopLogprobs | None] = [None] * len(nums)
    if not rows:
        return out
    wanted = logprobs if len(rows) == len(nums) else logprobs[torch.tensor(rows, device=logprobs.device)]
    # topk is sorted, so the first n of the top `most` are the top n.
    values, ids = (t.tolist() for t in wanted.topk(max(nums), dim=-1))
    for j, i in enumerate(rows):
        n = nums[i]
        out[i] = (values[j][:n], ids[j][:n])
    return out


def chosen_logprobs(logprobs: torch.Tensor, token_ids: list) -> list[TopLogprobs | None]:
    """Row i's logprobs at the ids `token_ids[i]` (None where None), in their order: one gather over
    the rows that want some and one copy to the host."""
    rows = [i for i, ids in enumerate(token_ids) if ids]
    out: list[TopLogprobs | None] = [None] * len(token_ids)
    if not rows:
        return out
    width = max(len(token_ids[i]) for i in rows)
    # Padded to one width with each row's first id (dropped again below).
    index = [list(token_ids[i]) + [token_ids[i][0]] * (width - len(token_ids[i])) for i in rows]
    device = logprobs.device
    # [rows, width] straight from the log_softmax (no copy of whole [rows, vocab] rows).
    wanted = logprobs[torch.tensor(rows, device=device)[:, None], torch.tensor(index, device=device)]
    for j, values in enumerate(wanted.tolist()):
        ids = list(token_ids[rows[j]])
        out[rows[j]] = (values[: len(ids)], ids)
    return out


def hidden_state_rows(hidden: torch.Tensor, fb: ForwardBatch) -> HiddenRows:
    """The rows of `hidden` of the positions each request of `fb.return_hidden_states_mask` ran: every
    extend position, a decode's one, a verify's first (such a request has no drafts); one gather, in
    float32, left on the device (the worker copies it with the step's results)."""
    mask = fb.return_hidden_states_mask
    if fb.forward_mode.is_decode():
        spans = [(i, 1) for i in range(fb.batch_size)]
    elif fb.forward_mode.is_target_verify():
        spans = [(s, 1) for s in fb.extend_start_loc_cpu]
    else:
        spans = list(zip(fb.extend_start_loc_cpu, fb.extend_seq_lens_cpu, strict=True))
    rows = [r for (s, n), wanted in zip(spans, mask, strict=True) if wanted for r in range(s, s + n)]
    values = hidden[torch.tensor(rows, dtype=torch.int64).to(hidden.device)].float()
    out: list[tuple[int, int] | None] = []
    at = 0
    for (_, n), wanted in zip(spans, mask, strict=True):
        out.append((at, n) if wanted else None)
        at += n if wanted else 0
    return HiddenRows(values, out)


class LogitsProcessor:
    def __call__(
        self, hidden: torch.Tensor, lm_head: torch.nn.Module, fb: ForwardBatch
    ) -> LogitsProcessorOutput:
        out = self._logits(hidden, lm_head, fb)
        if fb.return_hidden_states_mask is not None:
            out.hidden_states = hidden_state_rows(hidden, fb)
        return out

    def _logits(
        self, hidden: torch.Tensor, lm_head: torch.nn.Module, fb: ForwardBatch
    ) -> LogitsProcessorOutput:
        if not fb.forward_mode.is_extend() or fb.forward_mode.is_target_verify():
            # (A verify samples at every position.)
            return LogitsProcessorOutput(next_token_logits=lm_head(hidden))
        starts, lens = fb.extend_start_loc_cpu, fb.extend_seq_lens_cpu
        if not fb.return_logprob:
            return LogitsProcessorOutput(next_token_logits=lm_head(hidden[fb.extend_last_loc]))

        # Rows and targets as host lists, then one copy to the device (`move_to_device`). A target is
        # an input id (its offset in input_ids) or the next chunk's first token (offset past them).
        next_ids = fb.extend_logprob_next_ids_cpu or [None] * fb.batch_size
        rows, target_at, next_vals, counts, temps = [], [], [], [], []
        for i in range(fb.batch_size):
            if not fb.return_logprob_mask[i]:
                counts.append(0)
                continue
            begin, end = starts[i] + fb.extend_logprob_start_lens_cpu[i], starts[i] + lens[i]
            rows += range(begin, end - 1)
            target_at += range(begin + 1, end)
            if next_ids[i] is not None:
                rows.append(end - 1)
                target_at.append(fb.num_tokens + len(next_vals))
                next_vals.append(next_ids[i])
            counts.append(max(end - 1 - begin, 0) + (next_ids[i] is not None))
            temps.append(fb.sampling_info.temperatures[i : i + 1].expand(counts[-1]))
        rows_t, target_t, next_t = move_to_device(
            [torch.tensor(v, dtype=torch.int64) for v in (rows, target_at, next_vals)], hidden.device
        )
        bs = fb.batch_size
        out = LogitsProcessorOutput(
            next_token_logits=lm_head(hidden[fb.extend_last_loc]),
            input_token_logprobs=[[] for _ in range(bs)],
        )
        if not sum(counts):
            return out
        temps_t = torch.cat(temps)
        targets = torch.cat([fb.input_ids, next_t])[target_t]
        top_n = fb.top_logprobs_nums
        most = max((n for n, c in zip(top_n, counts, strict=True) if c > 0), default=0)
        wants_ids = fb.token_ids_logprobs
        if wants_ids is not None:
            # Each position of request i wants the same ids: its rows of lp, gathered at them.
            per_row = [ids for ids, c in zip(wants_ids, counts, strict=True) for _ in range(c)]
        # The rows' [rows, vocab] logits and log_softmax exist one chunk of rows at a time (upstream's
        # chunk size): a prefill chunk of 8,192 positions at Qwen3-Next's vocabulary would otherwise
        # take ~12 GB at once. One copy to the host per chunk and kind of values.
        values: list[float] = []
        top_v: list[list[float]] = []
        top_i: list[list[int]] = []
        chosen: list[TopLogprobs | None] = []
        step = max(envs.SGLANG_LOGITS_PROCESSER_CHUNK_SIZE.get(), 1)
        for lo in range(0, len(rows), step):
            hi = min(lo + step, len(rows))
            lp = scaled_log_softmax(lm_head(hidden[rows_t[lo:hi]]), temps_t[lo:hi])
            values += lp.gather(1, targets[lo:hi, None])[:, 0].tolist()
            if most > 0:
                chunk_v, chunk_i = lp.topk(most, dim=-1)
                top_v += chunk_v.tolist()
                top_i += chunk_i.tolist()
            if wants_ids is not None:
                chosen += chosen_logprobs(lp, per_row[lo:hi])
        if most > 0:
            out.input_top_logprobs = [[] for _ in range(bs)]
        if wants_ids is not None:
            out.input_token_ids_logprobs = [[] for _ in range(bs)]
        offset = 0
        for i, count in enumerate(counts):
            out.input_token_logprobs[i] = values[offset : offset + count]
            if wants_ids is not None and wants_ids[i] and count:
                out.input_token_ids_logprobs[i] = chosen[offset : offset + count]
            if most > 0 and top_n[i] > 0 and count:
                n = top_n[i]  # topk is sorted, so the first n of the top `most` are the top n
                out.input_top_logprobs[i] = [
                    (v[:n], ids[:n])
                    for v, ids in zip(
                        top_v[offset : offset + count], top_i[offset : offset + count], strict=True
                    )
                ]
            offset += count
        return out
