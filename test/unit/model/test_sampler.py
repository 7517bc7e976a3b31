"""Sampling: greedy at temperature 0; a seeded request draws the same tokens whatever batch it is in;
top-k, top-p and min-p keep the documented sets; frequencies follow the distribution; logprobs are those of
the temperature-scaled distribution, before truncation."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.environ import envs
from sglang.srt.layers import sampler as sampler_module
from sglang.srt.layers.logits_processor import chosen_logprobs, top_logprobs
from sglang.srt.layers.sampler import Sampler, inverse_cdf_sample, seeded_uniforms, truncated_probs
from sglang.srt.model_executor.forward_batch_info import SamplingBatchInfo
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=5, suite="per-commit-cpu")

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
DRAWS = 4000
# Binomial standard deviation of a frequency over 4000 draws is <= 0.008; 0.04 is five of them.
FREQ_TOL = 0.04


@pytest.fixture(params=["cpp", "torch"])
def backend(request):
    """The sampler's CPU paths: sgl-kernel's op and the torch form (`SGLANG_CPU_SAMPLING_BACKEND`)."""
    with envs.SGLANG_CPU_SAMPLING_BACKEND.override(request.param):
        yield request.param


def _frequencies(seed: int, **params) -> torch.Tensor:
    """Token frequencies of one seeded request sampled at DRAWS positions of PROBS (batched)."""
    logits = PROBS.log().repeat(DRAWS, 1)
    info = SamplingBatchInfo.create(
        [params.get("temperature", 1.0)] * DRAWS,
        [params.get("top_p", 1.0)] * DRAWS,
        [params.get("top_k", -1)] * DRAWS,
        [seed] * DRAWS,
        [params.get("min_p", 0.0)] * DRAWS,
    )
    ids = Sampler(random_seed=0)(logits, info, positions=torch.arange(DRAWS)).next_token_ids
    return torch.bincount(ids, minlength=4).float() / DRAWS


def test_frequencies_follow_the_distribution(backend):
    assert (_frequencies(seed=1) - PROBS).abs().max() < FREQ_TOL


@pytest.mark.parametrize(
    "params,kept",
    [
        ({"top_k": 2}, [0, 1]),
        ({"top_p": 0.6}, [0, 1]),  # 0.5 before token 1 is <= 0.6: kept; 0.8 before token 2 is not
        ({"top_p": 0.4}, [0]),
        ({"top_k": 3, "top_p": 0.9}, [0, 1, 2]),
        ({"min_p": 0.35}, [0, 1]),  # 0.15 < 0.35 * 0.5
    ],
)
def test_top_k_and_top_p_keep_the_documented_set(backend, params, kept):
    freq = _frequencies(seed=2, **params)
    want = torch.zeros(4)
    want[kept] = PROBS[kept] / PROBS[kept].sum()
    assert (freq - want).abs().max() < FREQ_TOL
    assert freq[[i for i in range(4) if i not in kept]].sum() == 0


def test_tokens_as_likely_as_the_cut_are_all_kept():
    logits = torch.tensor([0.3, 0.3, 0.3, 0.1]).log().repeat(3, 1)
    kept = truncated_probs(
        logits,
        torch.ones(3),
        top_ps=torch.tensor([1.0, 0.2, 1.0]),
        top_ks=torch.tensor([1, -1, -1]),
        min_ps=torch.tensor([0.0, 0.0, 0.9]),
        sort_width=-1,
    )
    assert (kept > 0).tolist() == [[True, True, True, False]] * 3


def _row_cut(row: torch.Tensor, top_p: float, top_k: int, min_p: float) -> torch.Tensor:
    """The documented cut of one row, through a sort of its whole vocabulary (float32 as the sampler)."""
    probs = torch.softmax(row, dim=-1)
    values = probs.sort(descending=True).values
    cut = torch.tensor(0.0)
    if top_k > 0:
        cut = values[min(top_k, len(values)) - 1]
    top_p32 = torch.tensor(top_p, dtype=torch.float32)
    if top_p32 < 1:
        kept = max(int(((values.cumsum(0) - values) <= top_p32).sum()), 1)
        cut = torch.maximum(cut, values[kept - 1])
    if min_p:
        cut = torch.maximum(cut, torch.tensor(min_p, dtype=torch.float32) * values[0])
    return probs.masked_fill(probs < cut, 0.0)


@settings(max_examples=80, deadline=None)
@given(
    st.integers(1, 60),
    st.lists(
        st.tuples(
            st.sampled_from([1.0, 0.99, 0.9, 0.5, 0.05]),
            st.sampled_from([-1, 0, 1, 2, 5, 9, 70]),
            st.sampled_from([0.0, 0.0, 0.1]),
            st.floats(0.1, 4.0),
        ),
        min_size=1,
        max_size=6,
    ),
    st.integers(0, 2**16),
)
def test_a_rows_cut_does_not_depend_on_its_batch_or_the_sort_taken(vocab, rows, seed):
    """Whatever the batch's sort width (its largest top_k, or the whole vocabulary) and, for top-p
    alone, whether the partial sort of the head (here 4 wide, so that both it and the fallback to a
    whole sort run) held every cut, each row gets the documented cut of it alone."""
    top_ps, top_ks, min_ps, scales = (list(c) for c in zip(*rows, strict=True))
    logits = torch.randn(len(rows), vocab, generator=torch.Generator().manual_seed(seed))
    logits = logits * torch.tensor(scales)[:, None]
    info = SamplingBatchInfo.create([1.0] * len(rows), top_ps, top_ks, min_ps=min_ps)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sampler_module, "TOP_P_HEAD", 4)
        got = truncated_probs(
            logits, info.temperatures, info.top_ps, info.top_ks, info.min_ps, info.sort_width
        )
    for i, (top_p, top_k, min_p, _) in enumerate(rows):
        assert torch.equal(got[i], _row_cut(logits[i], top_p, top_k, min_p))


@pytest.mark.parametrize("flat_row", [False, True])
def test_top_p_alone_sorts_only_the_head_when_it_holds_every_cut(monkeypatch, flat_row):
    """Peaked rows cut by top-p 0.5 within their 4 most likely tokens: only those are sorted. A flat row
    (its cut past the head) makes the batch sort the whole vocabulary. The cuts are the documented ones
    either way."""
    monkeypatch.setattr(sampler_module, "TOP_P_HEAD", 4)
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(5)) * 6
    if flat_row:
        logits[1] = 0.0
    info = SamplingBatchInfo.create([1.0] * 3, [0.5] * 3, [-1] * 3)
    assert info.sort_width == -1
    probs = torch.softmax(logits, dim=-1)
    values = sampler_module._most_likely_first(probs, 50, info.top_ps, info.top_ks)
    assert values.shape[-1] == (50 if flat_row else 4)
    got = truncated_probs(logits, info.temperatures, info.top_ps, info.top_ks, None, info.sort_width)
    for i in range(3):
        assert torch.equal(got[i], _row_cut(logits[i], 0.5, -1, 0.0))


def test_inverse_cdf_never_takes_a_zero_probability_id():
    """A uniform just below 1 makes u * total round up to the total in float32; the target must stay
    below it, or the search lands past the last id that has probability (here on ids 2-3, which have
    none)."""
    probs = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.0, 0.3, 0.0, 0.0]])
    u = torch.full((2,), 1 - 2**-25)  # rounds to 1.0 in float32
    assert inverse_cdf_sample(probs, u).tolist() == [1, 1]
    assert inverse_cdf_sample(probs, torch.zeros(2)).tolist() == [0, 1]  # leading zeros skipped too


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.just(0.0), st.floats(1e-6, 1.0)), min_size=1, max_size=40).filter(any),
    st.floats(0.0, 1.0),
)
def test_inverse_cdf_takes_the_id_where_the_cumulative_sum_passes_the_target(weights, u):
    probs = torch.tensor([weights])
    cdf = probs[0].cumsum(0)
    i = int(inverse_cdf_sample(probs, torch.tensor([u]))[0])
    assert weights[i] > 0
    target = min(u * cdf[-1].item(), cdf[-1].item())
    # The first id whose cumulative sum exceeds the target (the one below it does not), up to the
    # float32 rounding of the product (the kernel's target is float32 too, one rounding away).
    assert cdf[i].item() >= target * (1 - 1e-6)
    assert i == 0 or cdf[i - 1].item() <= target * (1 + 1e-6)


def test_inverse_cdf_never_takes_a_zero_probability_id_of_an_unsequential_sum(monkeypatch):
    """A parallel scan (CUDA's cumsum) may round the sum at an id of probability 0 above the one before
    it; exaggerated here to 1e-3, the search would land on such ids in about 5 % of the draws."""
    probs = torch.zeros(2000, 100)
    probs[:, ::2] = 0.02  # every other id cut
    real = torch.Tensor.cumsum

    def unsequential(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        return out + (self == 0) * 1e-3

    monkeypatch.setattr(torch.Tensor, "cumsum", unsequential)
    ids = inverse_cdf_sample(probs, torch.rand(2000, generator=torch.Generator().manual_seed(1)))
    assert (ids % 2 == 0).all()


def test_tiny_temperatures_sample_greedily():
    """As upstream (below 1e-6): logits divided by 1e-39 would overflow float32."""
    assert SamplingParams(temperature=1e-7).is_greedy and not SamplingParams(temperature=1e-5).is_greedy


def test_seeded_uniforms_are_uniform_and_differ_by_seed_and_position():
    positions = torch.arange(20000)
    u = seeded_uniforms(torch.full((20000,), 7), positions)
    k = u.double() * 2**23 - 0.5  # u = (k + 1/2) / 2^23 exactly, so never 0 or 1
    assert torch.equal(k, k.round()) and k.min() >= 0 and k.max() < 2**23
    # Deciles of 20,000 uniforms: each holds 2,000 +- 42 (binomial sd); 200 is almost five of them.
    counts = torch.histc(u, bins=10, min=0.0, max=1.0)
    assert (counts - 2000).abs().max() < 200
    assert not torch.equal(u, seeded_uniforms(torch.full((20000,), 8), positions))
    assert torch.equal(u, seeded_uniforms(torch.full((20000,), 7), positions))


def test_greedy_rows_and_scaled_logprobs(backend):
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0], [0.0, 3.0, 1.0, 2.0]])
    info = SamplingBatchInfo.create([0.0, 0.5], seeds=[None, 7])
    out = Sampler(random_seed=0)(
        logits, info, positions=torch.tensor([3, 9]), return_logprob=True, top_logprobs_nums=[2, 0]
    )
    assert out.next_token_ids[0] == 0
    token = int(out.next_token_ids[1])
    assert math.isclose(out.next_token_logprobs[0], torch.log_softmax(logits[0], -1)[0].item(), rel_tol=1e-6)
    assert math.isclose(
        out.next_token_logprobs[1], torch.log_softmax(logits[1] / 0.5, -1)[token].item(), rel_tol=1e-6
    )
    values, ids = out.next_token_top_logprobs[0]
    assert ids == [0, 1] and out.next_token_top_logprobs[1] is None
    assert math.isclose(values[1], torch.log_softmax(logits[0], -1)[1].item(), rel_tol=1e-6)


@pytest.mark.parametrize("return_logprob", [False, True])
def test_bfloat16_logits_are_sampled_as_their_float32_values(backend, return_logprob):
    """The logits come in the lm_head's dtype. A greedy step without logprobs takes the argmax of them
    as they are, with no float32 copy (at 256 x 151,936 bfloat16 logits the copy is 156 MB to write and
    read back on a GPU), and gets the ids the float32 logits give, ties to the first; anything more
    (here logprobs, and a sampled row) reads them in float32."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.to_float32 = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ == "_to_copy" and out.dtype == torch.float32 and out.dim() == 2:
                self.to_float32 += 1  # a [bs, vocab] float32 copy: the logits
            return out

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 257, generator=gen).to(torch.bfloat16)
    logits[1, [10, 20]] = 9.0  # a tie: the first one wins
    positions = torch.arange(6)
    greedy = SamplingBatchInfo.create([0.0] * 6)
    with Casts() as casts:
        out = Sampler(random_seed=0)(logits, greedy, positions, return_logprob=return_logprob)
    want = Sampler(random_seed=0)(logits.float(), greedy, positions, return_logprob=return_logprob)
    assert torch.equal(out.next_token_ids, want.next_token_ids) and out.next_token_ids[1] == 10
    assert casts.to_float32 == (1 if return_logprob else 0)
    if return_logprob:
        assert torch.equal(out.next_token_logprobs, want.next_token_logprobs)
    mixed = SamplingBatchInfo.create([0.0, 0.7, 0.0, 0.0, 1.0, 0.0], seeds=[None, 5, None, None, 6, None])
    with Casts() as casts:
        out = Sampler(random_seed=0)(logits, mixed, positions)
    assert casts.to_float32 == 1  # sampled rows read the logits in float32, once
    want = Sampler(random_seed=0)(logits.float(), mixed, positions)
    assert torch.equal(out.next_token_ids, want.next_token_ids)
    # Wider logits are read as they are.
    with Casts() as casts:
        Sampler(random_seed=0)(logits.double(), mixed, positions)
    assert casts.to_float32 == 0


@pytest.mark.parametrize("nums", [[3, 0, 1, 5], [2, 2], [0, 0]])
def test_top_logprobs_of_the_rows_that_want_them(nums):
    lp = torch.log_softmax(torch.randn(len(nums), 50), dim=-1)
    got = top_logprobs(lp, nums)
    for i, n in enumerate(nums):
        if n == 0:
            assert got[i] is None
        else:
            values, ids = lp[i].topk(n)
            assert got[i] == (values.tolist(), ids.tolist())


def test_token_ids_logprobs_are_the_sampled_distributions_at_the_asked_ids(backend):
    """Ragged lists, repeats and a row that asks none; the same (temperature-scaled) distribution as
    the sampled token's logprob, whichever sampling path the batch takes."""
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    info = SamplingBatchInfo.create([0.0, 0.8, 0.0], seeds=[None, 4, None])
    asked = [(5, 1, 5), None, (39,)]
    out = Sampler(random_seed=0)(
        logits, info, torch.arange(3), return_logprob=True, token_ids_logprobs=asked
    )
    for i, temperature in enumerate([1.0, 0.8, 1.0]):
        lp = torch.log_softmax(logits[i] / temperature, -1)
        if asked[i] is None:
            assert out.next_token_ids_logprobs[i] is None
            continue
        values, ids = out.next_token_ids_logprobs[i]
        assert ids == list(asked[i]) and torch.allclose(torch.tensor(values), lp[list(asked[i])], atol=1e-6)
    assert math.isclose(
        out.next_token_logprobs[1], torch.log_softmax(logits[1] / 0.8, -1)[out.next_token_ids[1]].item(),
        rel_tol=1e-6,
    )
    assert chosen_logprobs(logits, [None, None]) == [None, None]


def _sample_sequence(driver: RunnerDriver, prompt: list[int], seed: int, others: int) -> list[int]:
    params = {"temperature": 1.0, "top_p": 0.95, "top_k": 100}
    req = driver.new_request(seed=seed, **params)
    batch = [req] + [driver.new_request(seed=1000 + i, **params) for i in range(others)]
    if others:  # a greedy neighbour too
        batch.append(driver.new_request())
    driver.extend(
        [Extend(r, prompt if r is req else random_ids(23 + j, seed=j)) for j, r in enumerate(batch)]
    )
    tokens = [req.next_token]
    for _ in range(12):
        driver.decode(batch)
        tokens.append(req.next_token)
    return tokens


def test_seeded_sampling_does_not_depend_on_the_batch(backend):
    driver = RunnerDriver(make_runner("tiny-qwen3-next"))
    prompt = random_ids(30, seed=70)
    alone = _sample_sequence(driver, prompt, seed=123, others=0)
    batched = _sample_sequence(driver, prompt, seed=123, others=2)
    other_seed = _sample_sequence(driver, prompt, seed=124, others=0)
    assert alone == batched
    assert alone != other_seed


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.floats(0.0, 2.0),
            st.floats(0.01, 1.0),
            st.integers(-1, 50),
            st.one_of(st.none(), st.integers(0, 2**70)),
            st.floats(0.0, 1.0),
        ),
        max_size=12,
    )
)
def test_batch_info_holds_each_requests_parameters(rows):
    """`SamplingBatchInfo.create` packs its lists into tensors (and decides the host flags) as a plain
    `torch.tensor` of each list would, seeds as their low 64 bits."""
    temps, top_ps, top_ks, seeds, min_ps = (list(c) for c in zip(*rows, strict=True)) if rows else ([],) * 5
    info = SamplingBatchInfo.create(temps, top_ps, top_ks, seeds, min_ps)
    assert torch.equal(info.temperatures, torch.tensor(temps, dtype=torch.float32))
    assert torch.equal(info.top_ps, torch.tensor(top_ps, dtype=torch.float32))
    assert torch.equal(info.top_ks, torch.tensor(top_ks, dtype=torch.int64))
    assert info.has_seed.tolist() == [s is not None for s in seeds]
    bits = [(s or 0) % 2**64 for s in seeds]
    assert [b % 2**64 for b in info.seed_bits.tolist()] == bits
    if any(min_ps):
        assert torch.equal(info.min_ps, torch.tensor(min_ps, dtype=torch.float32))
    else:
        assert info.min_ps is None
    assert info.is_all_greedy == all(t <= 0 for t in temps)
    assert info.needs_truncation == (any(k > 0 for k in top_ks) or any(p < 1 for p in top_ps) or any(min_ps))
