"""Next-token sampling: greedy for temperature 0, else temperature, top-k, top-p with per-request seeds.

The rule (deterministic per request): a request with seed s sampling the token at sequence index p (its
seq_len after this forward) draws one uniform u = hash(s, p) in (0, 1) from a fixed integer hash (23
bits, exact in float32; upstream's seeded sampling takes 24), and takes the first vocab id v (in id
order) at which the cumulative probability q(0) + ... + q(v) exceeds u times the total, where q is the
softmax of logits / T restricted to the top-k and then the top-p set (inverse-CDF sampling, in float32
as `torch.multinomial`). The draw depends only on (s, p) and the request's own logits, so the same
request gives the same tokens in any batch. A request without a seed draws a fresh seed from the
sampler's generator on the device (seeded by --random-seed) at every step (one draw per row of a
sampled batch, so what an unseeded request gets depends on its batch).

One uniform per row, not one per vocab entry: the Gumbel-max rule this replaced hashed and took two
logarithms of every logit, ~20 passes over [batch, vocab], which took longer than the tiny model's
whole decode forward on CPU (timings: benchmark/README.md).

On CPU sampling is one sgl-kernel call (`sample_logits`, `SGLANG_CPU_SAMPLING_BACKEND`): the same rule
with its sums taken in blocks of 64 ids and the cut found among the weights of at least 2^-10 (then
2^-20, then all) of the largest, so a draw can differ from this file's torch form only where u lands
within rounding of a step of the cumulative sum, or a probability within rounding of the cut. Unless
top logprobs are asked for, the op also gives the drawn ids' logprobs (greedy batches included), in
place of a log_softmax over the whole batch.

top_k <= 0 keeps every token. Top-p keeps a token while the probability of the more likely tokens
before it is at most top_p (of the whole distribution, as SGLang). min_p drops tokens less likely than
min_p times the most likely one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang.srt.layers.cpu_ops import cpu_sampling_ops
from sglang.srt.layers.logits_processor import TopLogprobs, chosen_logprobs, scaled_log_softmax, top_logprobs
from sglang.srt.model_executor.forward_batch_info import SamplingBatchInfo

_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (xorshift-multiply) on int64 tensors holding values < 2^32; the products
    stay below 2^63, so nothing overflows."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    x = ((x >> 16) ^ x) * 0x45D9F3B & _M32
    return (x >> 16) ^ x


def seeded_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[len(seeds)] float32 uniforms (k + 1/2) / 2^23 for k = hash(seed, position) mod 2^23: inside
    (0, 1) and exact in float32 (24 significant bits; with 24 bits of k the largest would round to 1).
    `seeds` holds the low 64 bits of each seed as int64; both tensors are on the logits' device."""
    lo, hi, pos = seeds & _M32, (seeds >> 32) & _M32, positions.to(torch.int64) & _M32
    key = _mix32(_mix32(_mix32((lo + _GOLDEN) & _M32) ^ hi) ^ pos)
    return ((_mix32(key) >> 9).float() + 0.5) / float(1 << 23)


def inverse_cdf_sample(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[bs] ids: per row, the first id whose cumulative probability exceeds `uniforms` times the row's
    total (rows need not sum to 1). An id of probability 0 is never taken: the cumulative sum does not
    grow there, and the target is kept strictly below the total, which rounding of the product could
    otherwise reach."""
    # A parallel scan (CUDA's cumsum) may round the sum at an id of probability 0 one ulp above the id
    # before it, where the search could then land: such ids take the running maximum (exactly the sum
    # before them), which also keeps the sums sorted for the search. (CPU's cumsum is sequential:
    # adding 0 is exact there.)
    cdf = torch.where(probs > 0, probs.cumsum(dim=-1), 0.0).cummax(dim=-1).values
    total = cdf[:, -1:]
    target = torch.minimum(uniforms[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    ids = torch.searchsorted(cdf, target, right=True)[:, 0]
    return ids.clamp_(max=probs.shape[-1] - 1)


# Top-p alone (no top-k) needs each row's probabilities in order only down to its cut, which usually lies
# among the few most likely tokens: on a CPU the cut is first looked for among this many (a partial sort,
# far faster than sorting a large vocabulary), and the whole vocabulary is sorted only when some row's
# cut is not among them. (On a GPU the sort is fast, and the check would be a host sync.)
TOP_P_HEAD = 256


def truncated_probs(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ps: torch.Tensor,
    top_ks: torch.Tensor,
    min_ps: torch.Tensor | None = None,
    sort_width: int = -1,
) -> torch.Tensor:
    """softmax(logits / T) with the tokens below each row's cut zeroed. The cut is the largest of:
    the top_k-th largest probability; the probability of the last token (most likely first) whose more
    likely tokens sum to at most top_p (of the whole distribution, as SGLang; top_p >= 1: none); min_p
    times the largest probability. Tokens as likely as the cut are all kept (a set by value, so ties at
    the cut do not depend on an order among equals). `sort_width` (`SamplingBatchInfo.sort_width`): how
    many of each row's most likely probabilities the cut needs in order; -1: the whole vocabulary."""
    probs = torch.softmax(logits / temperatures[:, None], dim=-1)
    vocab = probs.shape[-1]
    cut = torch.zeros_like(temperatures)
    width = vocab if sort_width < 0 else min(sort_width, vocab)
    if width > 0:
        values = _most_likely_first(probs, width, top_ps, top_ks)
        width = values.shape[-1]
        kth = values.gather(1, (top_ks.clamp(1, width) - 1)[:, None])[:, 0]
        cut = torch.where(top_ks > 0, kth, cut)
        before = values.cumsum(dim=-1) - values  # non-decreasing: the kept tokens are a prefix
        kept = (before <= top_ps[:, None]).sum(dim=-1).clamp(min=1)
        last_kept = values.gather(1, (kept - 1)[:, None])[:, 0]
        cut = torch.maximum(cut, torch.where(top_ps < 1.0, last_kept, 0.0))
    if min_ps is not None:
        cut = torch.maximum(cut, min_ps * probs.amax(dim=-1))
    return probs.masked_fill(probs < cut[:, None], 0.0)


def _most_likely_first(
    probs: torch.Tensor, width: int, top_ps: torch.Tensor, top_ks: torch.Tensor
) -> torch.Tensor:
    """Each row's `width` largest probabilities in descending order; for `width` = the whole vocabulary
    on a CPU, possibly only the first TOP_P_HEAD when they hold every row's cut (the values are the same
    either way, so the result does not depend on the path)."""
    vocab = probs.shape[-1]
    if width < vocab:
        return probs.topk(width, dim=-1).values
    if probs.device.type == "cpu" and vocab > TOP_P_HEAD:
        head = probs.topk(TOP_P_HEAD, dim=-1).values
        # A row's cut is in the head when top-p already cuts its last head token (the more likely ones
        # exceed top_p: the top-k cut, if lower, then does not matter), or when its top-k is within the
        # head (a top-p cut past the head is then lower), or when it cuts by neither.
        top_p = top_ps < 1.0
        # (From the cumulative sum the cut itself takes, so that both paths decide alike to the ulp.)
        p_in_head = top_p & ((head.cumsum(dim=-1) - head)[:, -1] > top_ps)
        k_in_head = (top_ks > 0) & (top_ks <= TOP_P_HEAD)
        if bool((p_in_head | k_in_head | (~top_p & (top_ks <= 0))).all()):
            return head
    return probs.sort(dim=-1, descending=True).values


@dataclass
class SampleOutput:
    next_token_ids: torch.Tensor  # [bs] int64, on the logits' device
    next_token_logprobs: torch.Tensor | None = None  # [bs] float32, on the logits' device
    next_token_top_logprobs: list[TopLogprobs | None] | None = None
    next_token_ids_logprobs: list[TopLogprobs | None] | None = None  # `token_ids_logprobs` asked


class Sampler:
    def __init__(self, random_seed: int):
        self.random_seed = random_seed
        self._generators: dict[torch.device, torch.Generator | None] = {}

    def _generator(self, device: torch.device) -> torch.Generator | None:
        """The generator of fresh seeds on `device` (seeded by --random-seed); the `meta` device of the
        device audit has none and uses torch's default one."""
        if device not in self._generators:
            self._generators[device] = (
                None
                if device.type == "meta"
                else torch.Generator(device=device).manual_seed(self.random_seed)
            )
        return self._generators[device]

    def _uniforms(self, info: SamplingBatchInfo, positions: torch.Tensor) -> torch.Tensor:
        """Each row's uniform: from its seed, or (no seed) from a fresh one drawn on the device."""
        device = positions.device
        fresh = torch.randint(0, 2**62, info.has_seed.shape, generator=self._generator(device), device=device)
        return seeded_uniforms(torch.where(info.has_seed, info.seed_bits, fresh), positions)

    def __call__(
        self,
        logits: torch.Tensor,
        info: SamplingBatchInfo,
        positions: torch.Tensor,
        return_logprob: bool = False,
        top_logprobs_nums: list[int] | None = None,
        token_ids_logprobs: list | None = None,
    ) -> SampleOutput:
        """logits [bs, vocab] in float32 or wider, or in bfloat16 / float16 (read as float32: exact);
        positions[i] (on the logits' device) is the sequence index of request i's new token. Nothing
        here reads the device on the host, top logprobs and `token_ids_logprobs` (per row, the ids
        whose logprobs it wants, or None) aside."""
        if logits.element_size() < 4 and not (info.is_all_greedy and not return_logprob):
            # The argmax alone reads them as they are (the upcast changes no value and no order).
            logits = logits.float()
        ops = cpu_sampling_ops(logits.device) if logits.dtype == torch.float32 else None
        nums = top_logprobs_nums or []
        wants_top = return_logprob and any(n > 0 for n in nums)
        # Top logprobs and chosen ids' logprobs read the whole log_softmax.
        whole_lp = wants_top or (return_logprob and token_ids_logprobs is not None)
        # The op also writes the drawn ids' logprobs (top logprobs need the whole log_softmax anyway).
        op_logprobs = return_logprob and not whole_lp and ops is not None
        logprobs = None
        if ops is not None and (op_logprobs or not info.is_all_greedy):
            cut = info.needs_truncation
            logprobs = torch.empty(logits.shape[0]) if op_logprobs else None
            # (A greedy batch reads no uniform: it draws no fresh seeds, as the torch form.)
            greedy = info.is_all_greedy
            ids = ops.sample_logits(
                logits.contiguous(),
                info.temperatures,
                torch.zeros(logits.shape[0]) if greedy else self._uniforms(info, positions),
                info.top_ps if cut else None,
                info.top_ks if cut else None,
                info.min_ps,
                logprobs,
            )
        elif info.is_all_greedy:
            # max's indices are argmax's (the first maximum, NaN included), in less time than argmax on
            # CPU (timings: benchmark/README.md).
            ids = logits.max(dim=-1).indices
        else:
            # Every row is sampled and greedy rows (T <= 0) then take the argmax, so no host decision
            # needs the device temperatures.
            temps = torch.where(info.temperatures > 0, info.temperatures, 1.0)
            if info.needs_truncation:
                probs = truncated_probs(logits, temps, info.top_ps, info.top_ks, info.min_ps, info.sort_width)
            else:
                probs = torch.softmax(logits / temps[:, None], dim=-1)
            sampled = inverse_cdf_sample(probs, self._uniforms(info, positions))
            ids = torch.where(info.temperatures > 0, sampled, logits.max(dim=-1).indices)
        out = SampleOutput(next_token_ids=ids)
        if logprobs is not None:
            out.next_token_logprobs = logprobs
        elif return_logprob:
            lp = scaled_log_softmax(logits, info.temperatures)
            out.next_token_logprobs = lp.gather(1, ids[:, None])[:, 0]
            if wants_top:
                out.next_token_top_logprobs = top_logprobs(lp, nums)
            if token_ids_logprobs is not None:
                out.next_token_ids_logprobs = chosen_logprobs(lp, token_ids_logprobs)
        return out
