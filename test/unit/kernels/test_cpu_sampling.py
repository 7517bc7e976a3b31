"""sgl-kernel's C++ sampling (`sgl-kernel/csrc/sampling_cpu.cpp`) against its torch twin in
`layers/sampler.py`: greedy rows take exactly torch's first maximum (ties, NaN, infinities); sampled rows
take the inverse-CDF id of the same uniform, up to rounding at the steps of the cumulative sum; rows with
top-k / top-p / min-p cuts take only ids the documented cut keeps (ties at the cut all kept); the extreme
uniforms stay inside the row; the sampler picks the op for sampled float32 batches, and seeded draws
through it do not depend on the batch; the AVX2 and baseline twins agree."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.logits_processor import scaled_log_softmax
from sglang.srt.layers.sampler import Sampler, inverse_cdf_sample, truncated_probs
from sglang.srt.model_executor.forward_batch_info import SamplingBatchInfo
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

# The op sums exp in blocks of 64 with a polynomial exp (relative error < 1e-7); the twin takes libm's
# exp and one flat float32 cumulative sum. A draw can differ only where the target lies within a few
# float32 roundings of the total (~sqrt(vocab) x 6e-8, ~4e-6 at 5,000 ids at worst in practice) of a step
# of the cumulative sum: none of 10,000 rows of 2,048 ids did (measured), so a row whose id falls more than
# CDF_TOL (of a total of 1) outside its bracket, or more than 1 row in 200 that differs, is a wrong id.
CDF_TOL = 2e-6
MAX_MISMATCH = 0.005


def _twin(logits: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(logits / torch.where(temps > 0, temps, 1.0)[:, None], dim=-1)
    return torch.where(temps > 0, inverse_cdf_sample(probs, u), logits.max(dim=-1).indices)


def test_greedy_rows_take_torchs_first_maximum(ops):
    logits = torch.randn(6, 300).round(decimals=1)  # many ties for the maximum
    logits[1, 7] = float("nan")
    logits[1, 200] = float("nan")
    logits[2, 11] = float("inf")
    logits[3] = float("-inf")
    logits[4, :] = 0.5
    temps, u = torch.zeros(6), torch.rand(6)
    got = ops.sample_logits(logits, temps, u)
    assert got.tolist() == logits.max(dim=-1).indices.tolist()
    assert got[1] == 7 and got[3] == 0 and got[4] == 0


@pytest.mark.parametrize("vocab", [1, 63, 64, 65, 2048, 5000])
def test_sampled_rows_take_the_inverse_cdf_id_up_to_rounding(ops, vocab):
    rows = 400
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(rows, vocab, generator=gen) * torch.rand(rows, 1, generator=gen) * 6
    temps = torch.rand(rows, generator=gen) * 1.5 + 0.05
    u = torch.rand(rows, generator=gen)
    got, want = ops.sample_logits(logits, temps, u), _twin(logits, temps, u)
    assert ((got >= 0) & (got < vocab)).all()
    probs = torch.softmax(logits / temps[:, None], dim=-1).double()
    cdf = probs.cumsum(dim=-1)
    for r in torch.nonzero(got != want)[:, 0].tolist():
        i, target = int(got[r]), float(u[r]) * float(cdf[r, -1])
        assert cdf[r, i] >= target - CDF_TOL and (i == 0 or cdf[r, i - 1] <= target + CDF_TOL), r
    assert (got != want).float().mean() < MAX_MISMATCH


def test_the_extreme_uniforms_stay_inside_the_row(ops):
    logits = torch.randn(3, 200)
    logits[:, 150:] = -1e4  # the last ids hold almost nothing: a target at the total would run past them
    temps = torch.ones(3)
    top = ops.sample_logits(logits, temps, torch.full((3,), 1 - 2**-24))
    assert ((top >= 0) & (top < 200)).all()
    assert ops.sample_logits(logits, temps, torch.zeros(3)).tolist() == [0, 0, 0]


def test_rows_that_cannot_be_scaled_take_their_first_maximum(ops):
    """A temperature whose reciprocal overflows float32, a +inf logit and an all -inf row, with and
    without a top-p cut: the first maximum (the cut once read an empty gathering here and crashed)."""
    logits = torch.randn(3, 500)
    logits[1, 123] = float("inf")
    logits[2] = float("-inf")
    temps = torch.tensor([1e-39, 1.0, 1.0])
    want = logits.max(dim=-1).indices.tolist()
    for top_p in (None, torch.full((3,), 0.9)):
        got = ops.sample_logits(logits, temps, torch.rand(3), top_p)
        assert got.tolist() == want


# The op's logprob is (x - max) / T - log(sum of exp weights): a polynomial exp (relative error < 1e-7)
# summed in blocks against log_softmax's libm exp; measured within 2.4e-6 over 2,560 rows of 5,000 ids.
# A logprob of the truncated distribution instead, or of the wrong id, is off by 0.01 or more here.
LOGPROB_TOL = 1e-5


@pytest.mark.parametrize("cut", [False, True])
def test_logprobs_are_those_of_the_scaled_distribution_before_the_cut(ops, cut):
    rows, vocab = 64, 5000
    gen = torch.Generator().manual_seed(7)
    logits = torch.randn(rows, vocab, generator=gen) * 3
    temps = torch.rand(rows, generator=gen) + 0.2
    temps[:16] = 0.0  # greedy rows: the unscaled distribution
    logits[60, 3] = float("nan")
    logits[61, 9] = float("inf")
    top_ps = torch.full((rows,), 0.8) if cut else None
    got = torch.empty(rows)
    ids = ops.sample_logits(logits, temps, torch.rand(rows, generator=gen), top_ps, None, None, got)
    want = scaled_log_softmax(logits, temps).gather(1, ids[:, None])[:, 0]
    finite = torch.arange(rows) < 60
    assert (got[finite] - want[finite]).abs().max() < LOGPROB_TOL
    assert got[60:62].isnan().all() and want[60:62].isnan().all()


def test_the_sampler_takes_logprobs_from_the_op_unless_top_logprobs_are_asked(ops):
    logits, positions = torch.randn(5, 300) * 2, torch.arange(5)
    info = SamplingBatchInfo.create([0.0, 0.7, 1.0, 0.0, 1.3], seeds=[1, 2, 3, 4, 5])
    sampler = Sampler(random_seed=0)
    with envs.SGLANG_CPU_SAMPLING_BACKEND.override("cpp"):
        by_op = sampler(logits, info, positions, return_logprob=True)
        with_tops = sampler(logits, info, positions, return_logprob=True, top_logprobs_nums=[0, 2, 0, 0, 0])
    want = scaled_log_softmax(logits, info.temperatures).gather(1, by_op.next_token_ids[:, None])[:, 0]
    assert torch.equal(by_op.next_token_ids, with_tops.next_token_ids)
    assert (by_op.next_token_logprobs - want).abs().max() < LOGPROB_TOL
    assert torch.equal(with_tops.next_token_logprobs, want)
    assert by_op.next_token_top_logprobs is None and with_tops.next_token_top_logprobs[1] is not None


def test_bad_inputs_are_refused(ops):
    with pytest.raises(RuntimeError, match="contiguous float32"):
        ops.sample_logits(torch.randn(2, 8, dtype=torch.float64), torch.ones(2), torch.rand(2))
    with pytest.raises(RuntimeError, match=r"\[bs\]"):
        ops.sample_logits(torch.randn(2, 8), torch.ones(3), torch.rand(2))


def test_the_baseline_twin_agrees(ops, monkeypatch):
    logits, temps, u = torch.randn(300, 1000) * 3, torch.rand(300) + 0.1, torch.rand(300)
    temps[:50] = 0.0
    avx2 = ops.sample_logits(logits, temps, u)
    monkeypatch.setenv("SGLANG_TEST_CPU_OPS_BASELINE", "1")
    baseline = ops.sample_logits(logits, temps, u)
    assert torch.equal(avx2[:50], baseline[:50])  # greedy: exact
    assert (avx2 != baseline).float().mean() < MAX_MISMATCH


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_the_sampler_uses_the_op_for_sampled_float32_batches(ops, monkeypatch, backend):
    calls = []
    real = torch.ops.sgl_kernel.sample_logits

    def counting(*args):
        calls.append(args[3] is not None)  # with top_ps: a cut to make
        return real(*args)

    monkeypatch.setattr(torch.ops.sgl_kernel, "sample_logits", counting, raising=False)
    sampler, logits, positions = Sampler(random_seed=0), torch.randn(4, 64), torch.arange(4)
    with envs.SGLANG_CPU_SAMPLING_BACKEND.override(backend):
        plain = sampler(logits, SamplingBatchInfo.create([1.0, 0.0, 0.7, 1.0]), positions)
        sampler(logits, SamplingBatchInfo.create([1.0] * 4, top_ps=[0.9] * 4), positions)
        sampler(logits, SamplingBatchInfo.greedy(4), positions)
        sampler(logits.double(), SamplingBatchInfo.create([1.0] * 4), positions)
    assert calls == ([False, True] if backend == "cpp" else [])
    assert plain.next_token_ids[1] == logits[1].argmax()


def _reference_cut(probs: torch.Tensor, top_p: float, top_k: int, min_p: float) -> float:
    """The documented cut of one row (`layers/sampler.py`), in float64 from its sorted probabilities."""
    values = probs.double().sort(descending=True).values
    cut = values[min(top_k, len(values)) - 1].item() if top_k > 0 else 0.0
    if top_p < 1:
        kept = max(int(((values.cumsum(0) - values) <= top_p).sum()), 1)
        cut = max(cut, values[kept - 1].item())
    return max(cut, min_p * values[0].item())


@pytest.mark.parametrize("vocab", [7, 300, 3000])
@pytest.mark.parametrize("scale", [1.0, 5.0])
def test_cut_rows_take_only_kept_ids_as_the_twin_does(ops, vocab, scale):
    """Rows of every kind of cut, each drawn at 64 uniforms: every id is one the documented cut keeps (up
    to rounding at the cut), and the draws are the torch twin's but for rounding at the steps."""
    gen = torch.Generator().manual_seed(vocab)
    rows, draws = 24, 64
    top_ps = torch.tensor([1.0, 0.9, 0.5, 0.05, 0.95, 1.0] * 4)
    top_ks = torch.tensor([3, -1, 5, -1, 40, -1] * 4)
    min_ps = torch.tensor([0.0] * 18 + [0.2] * 6)
    logits = torch.randn(rows, vocab, generator=gen) * scale
    temps = torch.rand(rows, generator=gen) + 0.3
    rep = lambda t: t.repeat_interleave(draws, dim=0)  # noqa: E731
    u = torch.rand(rows * draws, generator=gen)
    got = ops.sample_logits(rep(logits), rep(temps), u, rep(top_ps), rep(top_ks), rep(min_ps))
    probs = torch.softmax(logits / temps[:, None], dim=-1)
    for r in range(rows):
        cut = _reference_cut(probs[r], float(top_ps[r]), int(top_ks[r]), float(min_ps[r]))
        ids = got[r * draws : (r + 1) * draws]
        assert (probs[r][ids] >= cut * (1 - 1e-5)).all(), r
    info = SamplingBatchInfo.create(
        rep(temps).tolist(), rep(top_ps).tolist(), rep(top_ks).tolist(), min_ps=rep(min_ps).tolist()
    )
    twin = inverse_cdf_sample(
        truncated_probs(
            rep(logits), info.temperatures, info.top_ps, info.top_ks, info.min_ps, info.sort_width
        ),
        u,
    )
    assert (got != twin).float().mean() < MAX_MISMATCH


@pytest.mark.parametrize("top_p,top_k", [(0.9, -1), (1.0, 5), (0.9, 2000)])
def test_a_cut_in_the_long_tail_is_found_past_the_first_gathering(ops, top_p, top_k):
    """One likely token and 2,999 tied ones each below 2^-10 of it, holding 60 % of the mass: the cut
    lies among the tail, which the first gathering (weights of at least 2^-10 of the largest) misses."""
    logits = torch.full((400, 3000), -8.0)  # exp(-8) = 3.4e-4 < 2^-10 = 9.8e-4
    logits[:, 0] = 0.0
    n = logits.shape[0]
    got = ops.sample_logits(
        logits,
        torch.ones(n),
        torch.rand(n),
        torch.full((n,), top_p),
        torch.full((n,), top_k, dtype=torch.long),
    )
    tail = (got != 0).float().mean()  # every tail token ties at the cut, so all are kept: ~0.5 of draws
    assert 0.4 < tail < 0.8


def test_ties_at_the_cut_are_all_kept(ops):
    logits = torch.tensor([0.3, 0.3, 0.3, 0.1]).log().repeat(600, 1)
    got = ops.sample_logits(
        logits,
        torch.ones(600),
        torch.rand(600),
        torch.full((600,), 0.2),
        torch.full((600,), 1, dtype=torch.long),
    )
    assert torch.bincount(got, minlength=4)[:3].min() > 150 and (got != 3).all()


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_seeded_draws_do_not_depend_on_the_batch(ops, backend):
    """Row 0 (seed 11, position 40) alone and among others, through either path."""
    logits = torch.randn(5, 512, generator=torch.Generator().manual_seed(3)) * 2
    with envs.SGLANG_CPU_SAMPLING_BACKEND.override(backend):
        draws = []
        for bs in (1, 5):
            info = SamplingBatchInfo.create([0.8] * bs, seeds=[11] + [None] * (bs - 1))
            positions = torch.tensor([40] + [7] * (bs - 1))
            draws.append(
                [
                    int(Sampler(random_seed=bs)(logits[:bs], info, positions).next_token_ids[0])
                    for _ in range(3)
                ]
            )
    assert draws[0] == draws[1] and len(set(draws[0])) == 1
