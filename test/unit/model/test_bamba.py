"""Bamba (`BambaForCausalLM`): the runner's logprobs equal transformers' (float32, teacher-forced)
through chunked prefills, decodes and batched extends over cached prefixes; its attention rotates half
of each head, as transformers fixes it for Bamba."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import (
    batched_extends_with_prefixes,
    decode_steps,
    make_runner,
    max_abs,
    prefill,
    random_ids,
)
from sglang.test.runner_driver import RunnerDriver

register_cpu_ci(est_time=4, suite="per-commit-cpu")

PRESET = "tiny-bamba"
# As test_logprobs_vs_oracle: float32 against float32 differs only in summation order (measured ~6e-6
# in logprob here); a wrong rotary width or state moves logprobs by 0.05 or more.
TOL = 1e-4


def test_chunked_prefill_and_decode_match_the_oracle(oracles):
    runner = make_runner(PRESET, page_size=16)
    attention = [layer.mixer for layer in runner.model.model.layers if not layer.is_linear]
    assert len(attention) == 2 and all(a.rotary_emb.rotary_dim == 8 for a in attention)  # half of 16
    driver = RunnerDriver(runner)
    req = driver.new_request()
    lps = prefill(driver, req, random_ids(150, seed=150), cuts=[7, 32, 100])
    lps += decode_steps(driver, [req], 16)[0]
    assert (
        max_abs(lps, oracles[PRESET].token_logprobs(req.token_ids + [req.next_token], start=1).tolist()) < TOL
    )


def test_batched_extends_with_prefixes_match_the_oracle(oracles):
    driver = RunnerDriver(make_runner(PRESET))
    reqs, lps = batched_extends_with_prefixes(driver, [0, 20, 64], [70, 1, 45], decode=5, seed=160)
    for req, got in zip(reqs, lps, strict=True):
        ref = oracles[PRESET].token_logprobs(req.token_ids + [req.next_token], start=1).tolist()
        assert max_abs(got, ref) < TOL
