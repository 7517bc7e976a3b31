"""Bamba (`BambaForCausalLM`): the runner's logprobs equal transformers' (float32, teacher-forced)
through chunked prefills, decodes and batched extends over cached prefixes; its attention rotates half
of each head, as transformers fixes it for Bamba."""

from __future__ import annotations

from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import (
    batched_extends_error,
    chunked_prefill_and_decode_error,
    make_runner,
)

register_cpu_ci(est_time=4, suite="per-commit-cpu")

PRESET = "tiny-bamba"
# As test_logprobs_vs_oracle: float32 against float32 differs only in summation order (measured ~6e-6
# in logprob here); a wrong rotary width or state moves logprobs by 0.05 or more.
TOL = 1e-4


def test_chunked_prefill_and_decode_match_the_oracle(oracles):
    attention = [layer.mixer for layer in make_runner(PRESET).model.model.layers if not layer.is_linear]
    assert len(attention) == 2 and all(a.rotary_emb.rotary_dim == 8 for a in attention)  # half of 16
    err = chunked_prefill_and_decode_error(
        PRESET, oracles[PRESET], prompt_len=150, cuts=[7, 32, 100], decode=16, seed=150
    )
    assert err < TOL


def test_batched_extends_with_prefixes_match_the_oracle(oracles):
    assert (
        batched_extends_error(PRESET, oracles[PRESET], prefixes=[0, 20, 64], extends=[70, 1, 45], seed=160)
        < TOL
    )
