"""The oracle is self-consistent: its incremental path equals its full forward, and its states,
read out in pool layout and injected into a fresh cache, reproduce the continuation."""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")

PRESETS = ["tiny-qwen3-next", "tiny-nemotron-h"]
# float32 round-off of the chunked kernels (~5e-7 relative) amplified through the tiny networks stays
# below this; the presets were conditioned for it (see make_tiny_model.WEIGHT_SCALES).
TOL = 1e-5


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (n,), generator=g).tolist()


def _token_lp(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.parametrize("name", PRESETS)
def test_incremental_matches_full_forward(name, oracles):
    ref = oracles[name]
    ids = _ids(240, seed=1)
    full = ref.token_logprobs(ids)
    # chunks of 7, 57, 36 and 1-token decode steps, then a 64-aligned chunk and the tail
    boundaries = [7, 64, 100, 101, 102, 103, 128, 192]
    inc = _token_lp(ref.incremental_logits(ids, boundaries), ids)
    assert (inc - full).abs().max().item() < TOL
    assert torch.equal(full, _token_lp(ref.logits(ids), ids))


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("p", [7, 64, 100])
def test_injected_states_reproduce_the_continuation(name, p, oracles):
    ref = oracles[name]
    ids = _ids(180, seed=2)
    full = ref.token_logprobs(ids, start=p + 1)
    states = ref.states_after(ids, p)
    assert set(states) == set(ref.arch.linear_layer_ids)
    cache = ref.cache_with_states(states, kv_source=ref.cache_after(ids, p))
    cont = _token_lp(ref.extend(cache, ids[p:], p), ids[p:])
    assert (cont - full).abs().max().item() < TOL

    # Negative control: the same continuation without the recurrent state is far off.
    zero = {i: type(s)(torch.zeros_like(s.conv), torch.zeros_like(s.ssm)) for i, s in states.items()}
    cache = ref.cache_with_states(zero, kv_source=ref.cache_after(ids, p))
    wrong = _token_lp(ref.extend(cache, ids[p:], p), ids[p:])
    assert (wrong - full).abs().max().item() > 0.5


@pytest.mark.parametrize("name", PRESETS)
def test_states_change_along_the_sequence(name, oracles):
    ref = oracles[name]
    ids = _ids(120, seed=3)
    a, b = ref.states_after(ids, 60), ref.states_after(ids, 120)
    layer = ref.arch.linear_layer_ids[0]
    assert not torch.allclose(a[layer].ssm, b[layer].ssm)
    # The conv state of a 2-token prefix is the two inputs right-aligned after a zero column.
    short = ref.states_after(ids, 2)[layer].conv
    assert torch.all(short[:, 0] == 0) and short[:, 1:].abs().sum() > 0


def test_greedy_matches_full_forward_argmax(oracles):
    ref = oracles["tiny-qwen3-next"]
    prompt = _ids(20, seed=4)
    out = ref.greedy(prompt, 8)
    logits = ref.logits(prompt + out)
    assert out == logits[len(prompt) - 1 : -1].argmax(-1).tolist()
