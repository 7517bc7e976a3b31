"""Logit penalties (sampling/penaltylib.py) through the real scheduler, checked step by step against the
transformers oracle: each output token must be the argmax, and its logprob the log-softmax, of the
oracle's logits with upstream's rules applied to the tokens sampled before it. Also: batches that mix
penalized and plain requests, rows handed from one request to the next, retraction, and the sampling
parameters' checks."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.sampling.penaltylib import PenaltySlots
from sglang.srt.sampling.sampling_params import SamplingParams, SamplingParamsError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, check_penalized_oracle, token_ids

register_cpu_ci(est_time=40, suite="per-commit-cpu")

QWEN = "tiny-qwen3-next"


@pytest.fixture(scope="module")
def h():
    harness = SchedulerHarness(QWEN, chunked_prefill_size=64)
    yield harness
    harness.sched.check_integrity()
    assert not harness.sched.penalty_slots.in_use, "every finished request gave its row back"
    harness.flush_and_check_empty()
    harness.shutdown()


def check_rules(oracle, prompt, out, freq=0.0, pres=0.0, rep=1.0, bias=None, min_new=0, stops=()) -> None:
    check_penalized_oracle(
        oracle, prompt, out, frequency_penalty=freq, presence_penalty=pres, repetition_penalty=rep,
        logit_bias=bias, min_new_tokens=min_new, stop_token_ids=list(stops),
    )  # fmt: skip


# A bias that makes one token win until the penalties outweigh it: the counts then decide the output.
BOOST = {11: 3.0}


@pytest.mark.parametrize(
    "penalties",
    [
        dict(frequency_penalty=0.7),
        dict(presence_penalty=1.5),
        dict(repetition_penalty=1.6),
        dict(frequency_penalty=0.4, presence_penalty=-0.3, repetition_penalty=0.8),
    ],
)
def test_penalties_follow_their_rules_against_the_oracle(h, oracles, penalties):
    prompt = token_ids(90, seed=7)  # longer than a chunk: the first chunk samples nothing
    plain = h.generate(prompt, max_new_tokens=24, logit_bias=BOOST)
    out = h.generate(prompt, max_new_tokens=24, logit_bias=BOOST, **penalties)
    check_rules(
        oracles[QWEN], prompt, out, penalties.get("frequency_penalty", 0.0),
        penalties.get("presence_penalty", 0.0), penalties.get("repetition_penalty", 1.0), BOOST,
    )  # fmt: skip
    assert plain.output_ids.count(11) > out.output_ids.count(11) or penalties.get("repetition_penalty", 1) < 1
    assert out.output_ids != plain.output_ids, "the penalties changed the output"


def test_logit_bias_and_min_new_tokens_against_the_oracle(h, oracles):
    prompt = token_ids(40, seed=8)
    plain = h.generate(prompt, max_new_tokens=12)
    forced = h.generate(prompt, max_new_tokens=6, logit_bias={300: 100.0})
    assert forced.output_ids == [300] * 6
    # The greedy first tokens as stop ids: banned for the first 4 tokens, allowed from the 5th on.
    stops = plain.output_ids[:3]
    out = h.generate(prompt, max_new_tokens=12, min_new_tokens=4, stop_token_ids=stops)
    assert not set(out.output_ids[:4]) & set(stops)
    check_rules(oracles[QWEN], prompt, out, min_new=4, stops=stops)
    # The greedy 4th token as the stop id: with min_new_tokens 4 it is banned there (the 4th token is
    # the last one banned), with 3 it ends the request there.
    k = next(i for i in range(3, 12) if plain.output_ids[i] not in plain.output_ids[:i])
    stop = plain.output_ids[k]
    banned = h.generate(prompt, max_new_tokens=k + 1, min_new_tokens=k + 1, stop_token_ids=[stop])
    assert banned.output_ids[:k] == plain.output_ids[:k] and banned.output_ids[k] != stop
    check_rules(oracles[QWEN], prompt, banned, min_new=k + 1, stops=[stop])
    ended = h.generate(prompt, max_new_tokens=12, min_new_tokens=k, stop_token_ids=[stop])
    assert ended.output_ids == plain.output_ids[: k + 1]
    assert ended.finished_reason == {"type": "stop", "matched": stop}
    avoided = h.generate(prompt, max_new_tokens=5, logit_bias={plain.output_ids[0]: -100.0})
    check_rules(oracles[QWEN], prompt, avoided, bias={plain.output_ids[0]: -100.0})
    assert avoided.output_ids[0] != plain.output_ids[0]


def test_mixed_batches_and_reused_rows_match_solo_runs(h):
    """Plain and penalized requests in the same batches (prefill and decode, overlap on), in two waves so
    that the second wave's requests take rows the first gave back: each output equals its solo run."""
    settings = [dict(), dict(frequency_penalty=0.9), dict(repetition_penalty=1.7), dict(presence_penalty=1.2)]
    prompts = [token_ids(20 + 7 * k, seed=30 + k) for k in range(8)]
    kwargs = [dict(logit_bias=BOOST, **settings[k % 4]) for k in range(8)]
    solo = [h.generate(prompts[k], max_new_tokens=16 + k, **kwargs[k]).output_ids for k in range(8)]
    for wave in (range(0, 4), range(4, 8)):
        rids = {k: h.submit(prompts[k], max_new_tokens=16 + k, **kwargs[k]) for k in wave}
        h.run()
        assert h.sched.penalty_slots.size <= 3, "3 count-penalized requests at a time: rows are reused"
        for k, rid in rids.items():
            assert h.outputs[rid].output_ids == solo[k], f"request {k} ({kwargs[k]})"


def test_the_counts_hold_exactly_the_kept_tokens(h):
    """A prompt in two chunks (the first samples a token nobody keeps) and a reused row: the row holds
    the request's output tokens, each as often as it was sampled, and nothing else."""
    for seed in (40, 41):  # the second request takes the row the first gave back
        out = h.generate(token_ids(100, seed=seed), max_new_tokens=5, logit_bias=BOOST, frequency_penalty=0.1)
        counts = h.sched.model_runner.penalizer.counts[0]  # the lowest row: no other request holds one
        assert torch.equal(counts, torch.bincount(torch.tensor(out.output_ids), minlength=counts.numel()).int())


def test_eos_is_banned_until_min_new_tokens_and_the_row_is_reused_after_a_stop(h):
    """EOS pushed up by a bias: banned for the first 3 tokens, then it ends the request (overlap on: the
    batch launched before that finish was processed also counted into the row); the next request takes
    the row and holds exactly its own tokens."""
    eos = min(h.sched.finisher.eos_token_ids)
    prompt = token_ids(30, seed=42)
    out = h.generate(
        prompt, max_new_tokens=10, min_new_tokens=3, ignore_eos=False, logit_bias={eos: 100.0}, frequency_penalty=0.1
    )
    assert eos not in out.output_ids[:3] and out.output_ids[3] == eos and len(out.output_ids) == 4
    assert out.finished_reason == {"type": "stop", "matched": eos}
    nxt = h.generate(prompt, max_new_tokens=3, frequency_penalty=0.1)
    counts = h.sched.model_runner.penalizer.counts[0]
    assert torch.equal(counts, torch.bincount(torch.tensor(nxt.output_ids), minlength=counts.numel()).int())


def test_counts_survive_retraction(oracles):
    # 8 requests x (30 + 60) tokens need ~720 KV slots; the pool has 512: some are retracted and prefill
    # their outputs again, keeping their rows of counts.
    h = SchedulerHarness(QWEN, mamba_scheduler_strategy="extra_buffer", max_total_tokens=512, max_running_requests=8)
    try:
        prompts = [token_ids(30, seed=70 + k) for k in range(8)]
        pen = dict(frequency_penalty=0.5, repetition_penalty=1.3, logit_bias=BOOST)
        rids = [h.submit(p, max_new_tokens=60, **pen) for p in prompts]
        h.run()
        assert h.sched.counters["num_retractions_total"] > 0
        for p, rid in zip(prompts, rids, strict=True):
            check_rules(oracles[QWEN], p, h.outputs[rid], 0.5, 0.0, 1.3, BOOST)
        h.sched.check_integrity()
        assert not h.sched.penalty_slots.in_use
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize(
    "params, field",
    [
        (dict(frequency_penalty=2.5), "frequency_penalty"),
        (dict(presence_penalty=-3), "presence_penalty"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(logit_bias={"x": 1}), "logit_bias"),
        (dict(logit_bias={"5": float("nan")}), "logit_bias"),
        (dict(logit_bias=[5]), "logit_bias"),
        (dict(logit_bias={"--5": 1}), "logit_bias"),
        (dict(logit_bias={"5": 101}), "logit_bias"),
    ],
)
def test_bad_penalties_name_their_field(params, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams.from_dict(params)


def test_logit_bias_keys_are_token_ids_in_the_vocabulary():
    assert SamplingParams.from_dict({"logit_bias": {"5": 2, 7: -1.5}}).logit_bias == {5: 2.0, 7: -1.5}
    with pytest.raises(SamplingParamsError, match="outside the vocabulary"):
        SamplingParams.from_dict({"logit_bias": {"600": 1}}).verify(vocab_size=512)


def test_penalty_slots_hand_out_the_lowest_free_row():
    slots = PenaltySlots()
    assert [slots.alloc() for _ in range(3)] == [0, 1, 2]
    slots.free(1)
    slots.free(0)
    assert slots.alloc() == 0 and slots.alloc() == 1 and slots.alloc() == 3
