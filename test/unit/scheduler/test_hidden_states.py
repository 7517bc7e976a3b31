"""return_hidden_states (upstream's, with --enable-return-hidden-states) through the real scheduler: the
lm_head's input at every position a request ran, against the transformers oracle's (a hook on its
lm_head), over chunked prefill, decode with overlap on and off, a prefix the cache holds (recomputed),
retraction (a re-prefill adds no row twice) and NGRAM verifies beside drafting requests."""

from __future__ import annotations

import pytest
import torch

from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, churn_harness, token_ids

register_cpu_ci(est_time=25, suite="per-commit-cpu")

QWEN, NEMOTRON = "tiny-qwen3-next", "tiny-nemotron-h"
# Engine vs oracle, float32: 5.2e-6 at most measured (Qwen3-Next and Nemotron-H, values up to ~4);
# a row of the wrong position or request differs by O(1).
TOL = 1e-4


def check_hidden_states(oracle, prompt: list[int], out) -> None:
    """One row per position fed: the prompt's and every output token's but the last."""
    got = torch.tensor(out.hidden_states)
    want = oracle.final_hidden_states(prompt + out.output_ids[:-1])
    assert got.shape == want.shape, (out.rid, got.shape, want.shape)
    err = (got - want).abs().max().item()
    assert err <= TOL, f"{out.rid}: max |dhidden| {err:.2e}"


@pytest.mark.parametrize("preset", [QWEN, NEMOTRON])
@pytest.mark.parametrize("overlap", [True, False])
def test_hidden_states_against_the_oracle(oracles, preset, overlap):
    flags = dict(chunked_prefill_size=64, disable_overlap_schedule=not overlap)
    h = SchedulerHarness(preset, enable_return_hidden_states=True, **flags)
    # Beside plain requests; one prompt longer than a chunk; one asks logprobs too.
    prompts = [token_ids(90, seed=1), token_ids(30, seed=2), token_ids(12, seed=3), token_ids(50, seed=4)]
    rids = [
        h.submit(prompts[0], max_new_tokens=7, return_hidden_states=True),
        h.submit(prompts[1], max_new_tokens=5),
        h.submit(prompts[2], max_new_tokens=9, return_hidden_states=True, return_logprob=True),
        h.submit(prompts[3], max_new_tokens=4),
    ]
    h.run()
    for k in (0, 2):
        check_hidden_states(oracles[preset], prompts[k], h.outputs[rids[k]])
    assert h.outputs[rids[1]].hidden_states == [] and h.outputs[rids[3]].hidden_states == []
    h.check_oracle(oracles[preset], prompts[2], h.outputs[rids[2]])
    # The same prompt again: the prefix cache holds it, but the positions are computed anew; a plain
    # request still hits.
    again = h.generate(prompts[0], max_new_tokens=3, return_hidden_states=True)
    assert again.cached_tokens == 0
    check_hidden_states(oracles[preset], prompts[0], again)
    assert h.generate(prompts[0], max_new_tokens=3).cached_tokens > 0
    h.sched.check_integrity()
    h.flush_and_check_empty()
    h.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", [QWEN, NEMOTRON])
def test_gpu_hidden_states_from_graph_replays(oracles, preset):
    """On CUDA, float32: decode rows come from CUDA graph replays (padded batches); 1e-3 as the other
    float32 GPU checks (test_strategy_matrix.GPU_ORACLE_TOL says why)."""
    h = SchedulerHarness(preset, enable_return_hidden_states=True, device="cuda", dtype="float32")
    assert h.sched.model_runner.graph_runner.use_graphs
    prompts = [token_ids(40 + 9 * k, seed=k) for k in range(3)]
    rids = [h.submit(p, max_new_tokens=8, return_hidden_states=k != 1) for k, p in enumerate(prompts)]
    h.run()
    for k in (0, 2):
        out = h.outputs[rids[k]]
        want = oracles[preset].final_hidden_states(prompts[k] + out.output_ids[:-1])
        assert (torch.tensor(out.hidden_states) - want).abs().max().item() <= 1e-3
    h.shutdown()


def test_hidden_states_survive_retraction(oracles):
    """A pool too small for the outputs: retracted requests prefill their tokens again (from where the
    prefix matched, at most the positions they have rows for) and add each row once."""
    h = churn_harness(overlap=True, enable_return_hidden_states=True)
    reqs = []
    for k in range(10):
        prompt = token_ids(10 + 9 * k, seed=k)
        reqs.append((prompt, h.submit(prompt, max_new_tokens=60 + 5 * k, return_hidden_states=k % 2 == 0)))
    h.run()
    assert h.sched.counters["num_retractions_total"] > 0
    for k, (prompt, rid) in enumerate(reqs):
        if k % 2 == 0:
            check_hidden_states(oracles[QWEN], prompt, h.outputs[rid])
    h.sched.check_integrity()
    h.shutdown()


def test_ngram_verifies_beside_a_request_with_hidden_states(oracles):
    """A request returning hidden states gets no drafts (one position per verify, its row); the drafting
    request's outputs are the plain ones."""
    prompt = token_ids(40, seed=3)
    spec = SchedulerHarness(
        QWEN, speculative_algorithm="NGRAM", speculative_num_draft_tokens=6, enable_return_hidden_states=True
    )
    spec.generate(prompt, max_new_tokens=40)  # its text is what the next requests draft from
    before = spec.sched.spec.stats["verify_steps"]
    drafting = spec.submit(prompt, max_new_tokens=40)
    hidden = spec.submit(prompt, max_new_tokens=20, return_hidden_states=True)
    spec.run()
    assert spec.sched.spec.stats["verify_steps"] - before >= 3
    assert spec.outputs[drafting].output_ids == oracles[QWEN].greedy(prompt, 40)
    check_hidden_states(oracles[QWEN], prompt, spec.outputs[hidden])
    spec.sched.check_integrity()
    spec.shutdown()
