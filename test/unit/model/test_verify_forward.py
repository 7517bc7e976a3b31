"""The speculative verify forward (`ForwardMode.TARGET_VERIFY`) against decode steps of the same tokens,
per layer kind (GDN, Mamba2, short conv, parallel attention + Mamba2): at every position the same
sampled token and logprob, the state after it in its verify row, and the running slot untouched; two
requests of different draft counts in one batch."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, max_abs, pool_state, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=8, suite="per-commit-cpu")

# Decode and verify run the same per-token step on the same states; only the attention differs (the
# extend path over the cached prefix against the decode path): float32 agreement measured at ~1e-6;
# a state one position off differs by > 1e-2.
TOL = 1e-4


def state_error(runner, slot: int, want) -> float:
    """Max error of every layer's conv and SSM state in `slot` against `want`, relative to the largest
    entry of each wanted tensor (the SSM state grows with the sequence; LFM2's SSM part is all zeros)."""
    got = pool_state(runner, slot)
    return max(
        (g - w).abs().max().item() / max(w.abs().max().item(), 1e-6)
        for layer, state in got.items()
        for g, w in ((state.conv, want[layer].conv), (state.ssm, want[layer].ssm))
    )


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h", "tiny-lfm2", "tiny-falcon-h1"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_positions_equal_decode_steps(preset, page_size):
    runner = make_runner(preset, page_size, speculative_algorithm="NGRAM", speculative_num_draft_tokens=5)
    pool, driver = runner.mamba_pool, RunnerDriver(runner)
    plain, first, second = (driver.new_request() for _ in range(3))
    prompts = [random_ids(37, seed=1), random_ids(37, seed=1), random_ids(20, seed=2)]
    driver.extend([Extend(r, p) for r, p in zip((plain, first, second), prompts, strict=True)])
    drafts = [[11, 12, 13, 14], [40]]  # 4 drafts and 1: rows of different lengths

    # The reference: `plain` decodes the same tokens one step at a time.
    ids, logprobs, states = [], [], []
    for token in [plain.next_token, *drafts[0]]:
        res = driver.decode([plain], input_ids=[token])
        ids.append(int(res.next_token_ids[0]))
        logprobs.append(float(res.next_token_logprobs[0]))
        states.append(pool_state(runner, plain.mamba_pool_idx))
    running = {r: pool_state(runner, r.mamba_pool_idx) for r in (first, second)}

    res = driver.verify([first, second], drafts)
    assert res.next_token_ids.shape[0] == 5 + 2
    assert res.next_token_ids[:5].tolist() == ids
    assert max_abs(res.next_token_logprobs[:5], logprobs) <= TOL
    for t, want in enumerate(states):
        assert state_error(runner, pool.verify_row(0, t), want) <= TOL, f"position {t}"
    for r in (first, second):
        assert state_error(runner, r.mamba_pool_idx, running[r]) == 0.0

    # `second`'s two positions: the same as decode steps of a fresh request with its prompt.
    want = []
    driver.free(plain)
    again = driver.new_request()
    driver.extend([Extend(again, prompts[2])])
    for token in [again.next_token, drafts[1][0]]:
        res2 = driver.decode([again], input_ids=[token])
        want.append((int(res2.next_token_ids[0]), pool_state(runner, again.mamba_pool_idx)))
    assert res.next_token_ids[5:].tolist() == [tok for tok, _ in want]
    for t, (_, state) in enumerate(want):
        assert state_error(runner, pool.verify_row(1, t), state) <= TOL
