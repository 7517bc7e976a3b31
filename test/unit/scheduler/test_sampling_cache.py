"""The decode batches' sampling-parameter cache: reused while the batch's requests have the same (or equal)
parameters in the same order, rebuilt when one arrives, leaves or is reordered, and every batch gets its
own object."""

from __future__ import annotations

import torch

from sglang.srt.managers.schedule_batch import Req, SamplingInfoCache
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")


def _req(i: int, **params) -> Req:
    return Req(str(i), [1, 2, 3], SamplingParams(**params))


def test_reused_for_the_same_requests_and_rebuilt_when_they_change():
    cache = SamplingInfoCache()
    a, b = _req(0, temperature=0.5, top_k=4), _req(1, temperature=0.0, sampling_seed=7)
    first = cache.get([a, b])
    again = cache.get([a, b])
    assert again is not first  # a batch's own copy: moving one to a device must not touch another
    assert again.temperatures is first.temperatures  # the host tensors themselves are shared
    assert first.temperatures.tolist() == [0.5, 0.0] and first.top_ks.tolist() == [4, -1]
    assert first.has_seed.tolist() == [False, True] and first.needs_truncation

    c = _req(2, temperature=0.75, top_p=0.5)
    grown = cache.get([a, b, c])
    assert grown.temperatures.tolist() == [0.5, 0.0, 0.75]
    swapped = cache.get([b, a])
    assert swapped.temperatures.tolist() == [0.0, 0.5] and swapped.has_seed.tolist() == [True, False]
    # Same length, one request replaced by another with different parameters.
    replaced = cache.get([b, _req(3, temperature=0.25)])
    assert torch.equal(replaced.temperatures, torch.tensor([0.0, 0.25]))
    # Another request with equal parameters in the same row: the same info, reused.
    twin = cache.get([b, _req(4, temperature=0.25)])
    assert twin.temperatures is replaced.temperatures
