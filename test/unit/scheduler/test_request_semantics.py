"""Request-level behaviour of the scheduler: logprobs, prefill-only requests, stop strings, streaming,
aborts, retraction, seeded sampling and the admission group."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.managers.io_struct import AbortReq
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import ORACLE_TOL, SchedulerHarness, token_ids

register_cpu_ci(est_time=30, suite="per-commit-cpu")

QWEN = "tiny-qwen3-next"


@pytest.fixture(scope="module")
def h():
    harness = SchedulerHarness(QWEN, mamba_scheduler_strategy="extra_buffer_lazy", chunked_prefill_size=128)
    yield harness
    harness.flush_and_check_empty()
    harness.shutdown()


@pytest.mark.parametrize("start", [0, 90])
def test_input_logprobs_despite_a_cached_prefix_and_chunking(h, start, oracles):
    prompt = token_ids(300, seed=50)
    h.generate(prompt[:200], max_new_tokens=1)  # caches a checkpoint at 192
    out = h.generate(prompt, max_new_tokens=3, logprob_start_len=start)
    ref = oracles[QWEN].token_logprobs(prompt, start=max(start, 1))
    got = out.input_logprobs
    assert [t for _, t in got] == prompt[start:]
    if start == 0:
        assert got[0][0] is None
        got = got[1:]
    assert (torch.tensor([lp for lp, _ in got]) - ref).abs().max().item() < ORACLE_TOL
    # The match stopped before the first position whose logprob is wanted.
    assert out.cached_tokens <= max(start - 1, 0)
    h.check_oracle(oracles[QWEN], prompt, out)


def test_token_ids_logprob_against_the_oracle(h, oracles):
    """upstream's token_ids_logprob: at every output position and every input position from
    logprob_start_len (the first input token has none), the logprobs of the asked ids, in their order,
    are the oracle's; through a prompt in chunks, a cached prefix, streamed deltas and a neighbour in
    the same batches that asks none."""
    prompt, ids = token_ids(260, seed=56), [5, 300, 7, 5]
    h.generate(prompt[:140], max_new_tokens=1)  # a checkpoint for the next requests to hit
    for start, stream in ((150, True), (0, False)):
        rid = h.submit(prompt, max_new_tokens=5, logprob_start_len=start, stream=stream, token_ids_logprob=ids)
        other = h.submit(token_ids(90, seed=57), max_new_tokens=7, logprob_start_len=3)
        h.run()
        out = h.outputs[rid]
        # Input logprobs from `start` on need those positions computed: the hit stops before them.
        assert (out.cached_tokens > 0) == (start > 0) and len(out.output_ids) == 5
        assert h.outputs[other].token_ids_logprobs == [] and h.outputs[other].input_token_ids_logprobs == []
        lp = oracles[QWEN].logprobs(prompt + out.output_ids)
        got = list(out.input_token_ids_logprobs)
        if start == 0:
            assert got[0] is None
            got = got[1:]
        # Input position p (from max(start, 1)) is scored by the logits at p - 1, output token j by
        # those at len(prompt) - 1 + j.
        first = max(start, 1)
        assert len(got) == len(prompt) - first and len(out.token_ids_logprobs) == 5
        for entries, row in zip(got + out.token_ids_logprobs, lp[first - 1 : -1], strict=True):
            assert [t for _, t in entries] == ids
            assert max(abs(v - row[t].item()) for v, t in entries) < ORACLE_TOL


def test_prefill_only_request_populates_the_cache(h):
    prompt = token_ids(150, seed=51)
    out = h.generate(prompt, max_new_tokens=0)
    assert out.output_ids == [] and out.finished_reason == {"type": "length", "length": 0}
    again = h.generate(prompt + [5, 6, 7], max_new_tokens=1)
    assert again.cached_tokens == 150, "the prompt's final state (its prefill snapshot sits at 128)"


def test_stop_string_finishes_the_request(h, oracles):
    prompt = token_ids(40, seed=52)
    greedy = oracles[QWEN].greedy(prompt, 12)
    text = h.sched.finisher.tokenizer.decode(greedy[8:10])
    out = h.generate(prompt, max_new_tokens=12, stop=[text])
    assert out.finished_reason == {"type": "stop", "matched": text}
    assert len(out.output_ids) <= 10 and out.output_ids == greedy[: len(out.output_ids)]


def test_streaming_sends_deltas_that_add_up(h):
    prompt = token_ids(30, seed=53)
    whole = h.generate(prompt, max_new_tokens=9)
    streamed = h.generate(prompt, max_new_tokens=9, stream=True)
    assert streamed.output_ids == whole.output_ids and streamed.logprobs == whole.logprobs
    assert streamed.messages >= 5 and whole.messages == 1


def test_a_temperature_beyond_float32_samples(h):
    # 16 alike requests pack their temperatures with `struct`, which refused 1e39 and crashed the step.
    rids = [h.submit(token_ids(12, seed=60 + k), max_new_tokens=3, temperature=1e39) for k in range(16)]
    h.run()
    assert all(len(h.outputs[r].output_ids) == 3 for r in rids)


def test_a_top_k_beyond_the_vocabulary_keeps_every_token(h):
    # 10**20 does not fit the batch's int64 tensor: it crashed the step; any top_k >= the vocabulary
    # keeps every token, as -1 does.
    prompt = token_ids(12, seed=66)
    sampling = dict(temperature=0.8, sampling_seed=5)
    huge = h.generate(prompt, max_new_tokens=4, top_k=10**20, **sampling)
    assert huge.output_ids == h.generate(prompt, max_new_tokens=4, top_k=-1, **sampling).output_ids


def test_seeded_sampling_does_not_depend_on_the_batch(h):
    prompt = token_ids(25, seed=54)
    sampling = dict(temperature=0.9, top_p=0.9, top_k=50, sampling_seed=1234)
    alone = h.generate(prompt, max_new_tokens=10, **sampling)
    rid = h.submit(prompt, max_new_tokens=10, **sampling)
    for k in range(5):
        h.submit(token_ids(20 + k, seed=55 + k), max_new_tokens=6, temperature=0.7)
    h.run()
    assert h.outputs[rid].output_ids == alone.output_ids
    other = h.generate(prompt, max_new_tokens=10, **{**sampling, "sampling_seed": 99})
    assert other.output_ids != alone.output_ids


def test_abort_waiting_running_and_all(h):
    sched = h.sched
    running = h.submit(token_ids(40, seed=60), max_new_tokens=50)
    for _ in range(4):
        sched.step()  # prefill and a few decode steps; one batch still in flight (overlap)
    waiting = h.submit(token_ids(40, seed=61), max_new_tokens=5)
    sched.process_input_requests([AbortReq(rid=waiting), AbortReq(rid=running)])
    others = [h.submit(token_ids(30, seed=62 + k), max_new_tokens=30) for k in range(3)]
    sched.step()
    sched.process_input_requests([AbortReq(abort_all=True)])
    h.run()
    for rid in [waiting, running, *others]:
        assert h.outputs[rid].finished_reason["type"] == "abort", rid
    assert 0 < len(h.outputs[running].output_ids) < 50 and h.outputs[waiting].output_ids == []
    sched.process_input_requests([AbortReq(rid="unknown")])
    assert sched.is_idle()
    sched.check_integrity()


def test_retraction_when_the_kv_pool_runs_out(oracles):
    # 8 requests x (30 + 60) tokens need ~720 KV slots; the pool has 512.
    h = SchedulerHarness(
        QWEN, mamba_scheduler_strategy="extra_buffer", max_total_tokens=512, max_running_requests=8
    )
    try:
        prompts = [token_ids(30, seed=70 + k) for k in range(8)]
        rids = [h.submit(p, max_new_tokens=60) for p in prompts]
        h.run()
        assert h.sched.counters["num_retractions_total"] > 0
        for p, rid in zip(prompts, rids, strict=True):
            assert len(h.outputs[rid].output_ids) == 60
            h.check_oracle(oracles[QWEN], p, h.outputs[rid])
        h.flush_and_check_empty()
    finally:
        h.shutdown()


def test_a_request_that_outgrows_the_whole_kv_pool_is_aborted():
    h = SchedulerHarness(QWEN, max_total_tokens=256)
    try:
        out = h.generate(token_ids(200, seed=91), max_new_tokens=100)
        assert out.finished_reason["type"] == "abort" and "KV cache holds" in out.finished_reason["message"]
        assert 0 < len(out.output_ids) < 100 and h.sched.counters["num_retractions_total"] == 0
        h.flush_and_check_empty()
    finally:
        h.shutdown()


def test_admission_pass_runs_in_one_capped_slot_group():
    h = SchedulerHarness(QWEN, mamba_scheduler_strategy="extra_buffer", max_running_requests=4)
    alloc = h.sched.req_to_token_pool.mamba_allocator
    caps = []
    begin = alloc.alloc_group_begin
    alloc.alloc_group_begin = lambda n: caps.append(n) or begin(n)
    try:
        for k in range(10):
            h.submit(token_ids(20, seed=80 + k), max_new_tokens=3)
        h.sched.step()
        # Four may run: the group covers 4 requests x 3 resident slots, not the 10 waiting.
        assert caps == [4 * 3] and len(h.sched.running) == 4 and not alloc.group_open
        h.run()
        assert all(c <= 4 * 3 for c in caps) and len(caps) > 1
    finally:
        h.shutdown()


def test_inputs_the_pool_cannot_hold_are_refused():
    h = SchedulerHarness(QWEN, max_total_tokens=256)
    try:
        out = h.generate(token_ids(400, seed=90), max_new_tokens=2)
        assert (
            out.finished_reason["type"] == "abort"
            and "longer than the limit" in out.finished_reason["message"]
        )
        assert h.sched.is_idle()
        h.flush_and_check_empty()
    finally:
        h.shutdown()
