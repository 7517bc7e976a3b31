"""The chunked linear-attention kernels equal their one-token recurrences, with the intermediate-state
convention of both: index i holds the state after i kernel chunks (0 = the initial state)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.attention.linear.gated_delta_rule import (
    chunk_gated_delta_rule,
    l2norm,
    recurrent_gated_delta_rule_step,
)
from sglang.srt.layers.attention.mamba.causal_conv1d import causal_conv1d_extend, causal_conv1d_update
from sglang.srt.layers.attention.mamba.ssd import selective_state_update, ssd_chunk_scan
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

# float32 reordering of sums over <= 150 steps; a wrong decay or state index errs by O(0.1).
TOL = 1e-5


def _stepwise(step, length: int, state: torch.Tensor):
    outs, states = [], [state]
    for t in range(length):
        out, state = step(t, state)
        outs.append(out)
        states.append(state)
    return torch.stack(outs), states


@pytest.mark.parametrize("length", [1, 63, 64, 150])
def test_chunked_gated_delta_rule_equals_the_recurrence(length):
    g = torch.Generator().manual_seed(length)
    h, k, v = 4, 16, 8
    q = l2norm(torch.randn(length, h, k, generator=g)) * k**-0.5
    key = l2norm(torch.randn(length, h, k, generator=g))
    val = torch.randn(length, h, v, generator=g)
    decay = -torch.rand(length, h, generator=g) * 0.2
    beta = torch.rand(length, h, generator=g)
    s0 = torch.randn(h, v, k, generator=g) * 0.3
    out, final, inter = chunk_gated_delta_rule(q, key, val, decay, beta, s0, 64, return_intermediate=True)

    def step(t, s):
        o, s = recurrent_gated_delta_rule_step(
            q[t : t + 1], key[t : t + 1], val[t : t + 1], decay[t : t + 1], beta[t : t + 1], s[None]
        )
        return o[0], s[0]

    ref_out, ref_states = _stepwise(step, length, s0)
    assert (out - ref_out).abs().max() < TOL and (final - ref_states[-1]).abs().max() < TOL
    assert inter.shape[0] == length // 64 + 1
    for i in range(inter.shape[0]):
        assert (inter[i] - ref_states[64 * i]).abs().max() < TOL


@pytest.mark.parametrize("length", [5, 32, 100])
def test_ssd_chunk_scan_equals_the_selective_state_update(length):
    g = torch.Generator().manual_seed(length)
    h, p, n = 4, 8, 16
    x = torch.randn(length, h, p, generator=g)
    dt = torch.rand(length, h, generator=g) * 0.1 + 0.01
    A = -torch.rand(h, generator=g) * 4
    B, C = torch.randn(length, h, n, generator=g), torch.randn(length, h, n, generator=g)
    D = torch.randn(h, generator=g)
    s0 = torch.randn(h, p, n, generator=g) * 0.3
    y, final, inter = ssd_chunk_scan(x, dt, A, B, C, D, s0, 32, return_intermediate=True)

    def step(t, s):
        o, s = selective_state_update(s[None], x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D)
        return o[0], s[0]

    ref_y, ref_states = _stepwise(step, length, s0)
    assert (y - ref_y).abs().max() < TOL and (final - ref_states[-1]).abs().max() < TOL
    assert inter.shape[0] == length // 32 + 1
    for i in range(inter.shape[0]):
        assert (inter[i] - ref_states[32 * i]).abs().max() < TOL


def test_causal_conv_extend_equals_token_updates():
    g = torch.Generator().manual_seed(0)
    c, kernel, length = 6, 4, 9
    x = torch.randn(length, c, generator=g)
    w, b = torch.randn(c, kernel, generator=g), torch.randn(c, generator=g)
    state = torch.randn(c, kernel - 1, generator=g)
    out, window = causal_conv1d_extend(x, state, w, b)
    s = state[None]
    for t in range(length):
        o, s = causal_conv1d_update(x[t : t + 1], s, w, b)
        assert (o[0] - out[t]).abs().max() < TOL
        # Rows t+1 .. t+K-1 of the window are the state after t+1 tokens.
        assert torch.equal(window[t + 1 : t + kernel].t(), s[0])
