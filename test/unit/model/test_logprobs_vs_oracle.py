"""The runner's logprobs equal transformers' (float32, teacher-forced: the oracle scores the tokens the
runner produced) for one-shot and chunked prefills, decodes, batched extends with different prefixes,
and extends from unaligned prefixes."""

from __future__ import annotations

import pytest

from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import decode_steps, make_runner, max_abs, prefill, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=8, suite="per-commit-cpu")

PRESETS = ["tiny-qwen3-next", "tiny-nemotron-h"]
# float32 against float32: the kernels differ from transformers' only in summation order (~1e-7
# relative); the presets are conditioned so that this stays below ~5e-6 in logprob (measured), and
# 1e-4 is the bound. A wrong state, position or mask moves logprobs by 0.05 or more.
TOL = 1e-4


def _score(oracle, tokens: list[int]) -> list[float]:
    return oracle.token_logprobs(tokens, start=1).tolist()


@pytest.mark.parametrize("preset", PRESETS)
def test_one_shot_prefill_then_32_decode_steps(preset, oracles):
    driver = RunnerDriver(make_runner(preset))
    req = driver.new_request()
    prompt = random_ids(150, seed=1)
    prefill_lps = prefill(driver, req, prompt)
    assert len(prefill_lps) == len(prompt)
    ref = _score(oracles[preset], prompt + [req.next_token])
    assert max_abs(prefill_lps, ref) < TOL

    decode_lps = decode_steps(driver, [req], 32)[0]
    tokens = req.token_ids + [req.next_token]
    assert len(tokens) == 150 + 33
    assert max_abs(prefill_lps + decode_lps, _score(oracles[preset], tokens)) < TOL


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("chunk", [7, 64, 100])
def test_chunked_prefill(preset, chunk, oracles):
    driver = RunnerDriver(make_runner(preset, page_size=16))
    req = driver.new_request()
    prompt = random_ids(230, seed=2)
    lps = prefill(driver, req, prompt, cuts=range(chunk, len(prompt), chunk))
    lps += decode_steps(driver, [req], 4)[0]
    assert max_abs(lps, _score(oracles[preset], req.token_ids + [req.next_token])) < TOL


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("prefix_len", [7, 48])
def test_extend_from_unaligned_prefix(preset, prefix_len, oracles):
    driver = RunnerDriver(make_runner(preset))
    req = driver.new_request()
    prompt = random_ids(prefix_len + 170, seed=3)
    # The long extend crosses several kernel chunks, which now start at the unaligned prefix.
    lps = prefill(driver, req, prompt, cuts=[prefix_len])
    lps += decode_steps(driver, [req], 3)[0]
    assert max_abs(lps, _score(oracles[preset], req.token_ids + [req.next_token])) < TOL


@pytest.mark.parametrize("preset", PRESETS)
def test_batched_extend_with_different_prefixes_then_batched_decode(preset, oracles):
    driver = RunnerDriver(make_runner(preset, page_size=16))
    prefixes, extends = [0, 7, 64, 100], [90, 33, 140, 1]
    prompts = [random_ids(p + e, seed=10 + i) for i, (p, e) in enumerate(zip(prefixes, extends, strict=True))]
    reqs = [driver.new_request() for _ in prompts]
    lps: list[list[float]] = [[] for _ in reqs]

    first = [Extend(r, p[:n], next_token=p[n]) for r, p, n in zip(reqs, prompts, prefixes, strict=True) if n]
    res = driver.extend(first)
    for it, got in zip(first, res.input_token_logprobs, strict=True):
        lps[reqs.index(it.req)] += got

    res = driver.extend([Extend(r, p[n:]) for r, p, n in zip(reqs, prompts, prefixes, strict=True)])
    for i in range(len(reqs)):
        lps[i] += res.input_token_logprobs[i] + [float(res.next_token_logprobs[i])]
    for i, step in enumerate(decode_steps(driver, reqs, 8)):
        lps[i] += step

    for i, req in enumerate(reqs):
        tokens = req.token_ids + [req.next_token]
        assert len(tokens) == prefixes[i] + extends[i] + 9
        assert max_abs(lps[i], _score(oracles[preset], tokens)) < TOL, f"request {i}"


def test_nemotron_h_latent_moe(tmp_path):
    """Nemotron 3 Super's LatentMoE (`moe_latent_size`): the routed experts run between a down and an
    up projection of the routed tokens; the shared expert and the router read the hidden state."""
    from sglang.srt.models.nemotron_h import NemotronHMoE
    from sglang.test.reference import ReferenceModel
    from sglang.tools.make_tiny_model import make_tiny_model

    folder = str(make_tiny_model("nemotron_h", tmp_path / "latent", overrides={"moe_latent_size": 24}))
    runner = make_runner(folder, page_size=16)
    moe = next(b.mixer for b in runner.model.backbone.layers if isinstance(b.mixer, NemotronHMoE))
    assert moe.experts.w13.shape[-1] == 24 and moe.fc1_latent_proj.weight.shape == (24, 64)
    driver = RunnerDriver(runner)
    req = driver.new_request()
    lps = prefill(driver, req, random_ids(120, seed=5), cuts=[50])
    lps += decode_steps(driver, [req], 8)[0]
    assert max_abs(lps, _score(ReferenceModel(folder), req.token_ids + [req.next_token])) < TOL
