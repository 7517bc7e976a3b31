"""`--speculative-algorithm NGRAM` against plain decoding of the same requests: the same tokens (greedy
and seeded sampling), logprobs, top logprobs and cache hits, per architecture x strategy x page size,
with drafts accepted, cut by a finish, and refused (penalties); under KV pressure (retractions); and the
flags' checks. Integrity is checked after every phase and nothing is held after a flush.

Why equal: a verify samples position t from the logits plain decoding computes after the same tokens,
with the same seed hash (module docstring of speculative/ngram_worker.py), and keeps the state of the
last committed position, which a later turn then hits."""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import per_commit_cases, register_cpu_ci
from sglang.test.model_checks import make_runner, pool_state
from sglang.test.runner_driver import Extend, RunnerDriver
from sglang.test.scheduler_harness import (
    ORACLE_TOL,
    Output,
    SchedulerHarness,
    churn_harness,
    run_churn,
    token_ids,
)

register_cpu_ci(est_time=56, suite="per-commit-cpu")

QWEN, NEMO = "tiny-qwen3-next", "tiny-nemotron-h"
SPEC = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)
# (preset, strategy, page size): GDN, Mamba2, short conv and parallel hybrid layers; every strategy.
CONFIGS = [
    (QWEN, "extra_buffer", 1),
    (QWEN, "no_buffer", 1),
    (NEMO, "extra_buffer_lazy", 16),
    (NEMO, "extra_buffer", 128),
    ("tiny-lfm2", "extra_buffer", 16),
    ("tiny-falcon-h1", "extra_buffer_lazy", 1),
]
# Greedy, seeded top-p sampling, and greedy with top logprobs and chosen ids' logprobs.
SAMPLING = [
    {},
    {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 11},
    {"top_logprobs_num": 3, "token_ids_logprob": [5, 17]},
    {"temperature": 1.3, "top_k": 20, "sampling_seed": 3},
]


def _harness(preset: str, strategy: str, page: int, spec: bool, **kw) -> SchedulerHarness:
    args = dict(
        mamba_scheduler_strategy=strategy,
        page_size=page,
        disable_overlap_schedule=True,
        mamba_track_interval=128,  # decode snapshots inside the outputs below
        chunked_prefill_size=256,
    )
    args.update(kw)
    return SchedulerHarness(preset, **args, **(SPEC if spec else {}))


def _plain_and_ngram(body: Callable[[SchedulerHarness, bool], Any], *config, **kw) -> dict[bool, Any]:
    """`body(h, spec)` on a plain harness and on an NGRAM one (`_harness(*config, spec, **kw)`), in turn;
    their results by `spec`."""
    preset, strategy, page = config or (QWEN, "extra_buffer", 1)
    out = {}
    for spec in (False, True):
        h = _harness(preset, strategy, page, spec, **kw)
        try:
            out[spec] = body(h, spec)
        finally:
            h.shutdown()
    return out


def _turns(h: SchedulerHarness) -> list[list[Output]]:
    """Turn 1: four requests; turn 2: the same prompts (drafts from turn 1's outputs), the prefix cache
    emptied before; turn 3: each prompt with its turn-1 output (the same as turn 2's) and five more tokens,
    hitting what turn 2's steps left in the tree: with NGRAM, mostly verifies."""
    prompts = [token_ids(40 + 17 * k, seed=k) for k in range(4)]
    turns = []
    for turn in range(3):
        rids = []
        for k, prompt in enumerate(prompts):
            if turn == 2:
                prompt = prompt + turns[0][k].output_ids + token_ids(5, seed=50 + k)
            rids.append(h.submit(prompt, max_new_tokens=70 - 8 * k if turn < 2 else 30, **SAMPLING[k]))
        h.run()
        h.sched.check_integrity()
        turns.append([h.outputs[r] for r in rids])
        if turn == 0:
            assert h.sched.flush_cache()[0]
    return turns


def _assert_same(plain: Output, spec: Output, what: str) -> None:
    assert spec.output_ids == plain.output_ids, what
    assert spec.finished_reason == plain.finished_reason, what
    assert spec.cached_tokens == plain.cached_tokens, what
    # Both sides match the oracle to ~1e-5 (measured: <= 7e-6 apart); a wrong state costs > 0.5.
    for a, b in zip(plain.logprobs, spec.logprobs, strict=True):
        assert abs(a - b) <= ORACLE_TOL, what
    for a, b in zip(
        plain.top_logprobs + plain.token_ids_logprobs, spec.top_logprobs + spec.token_ids_logprobs, strict=True
    ):
        assert [i for _, i in a] == [i for _, i in b], what
        assert max(abs(x - y) for (x, _), (y, _) in zip(a, b, strict=True)) <= ORACLE_TOL, what


@pytest.mark.parametrize("preset,strategy,page", CONFIGS)
def test_same_outputs_and_hits_as_plain_decoding(preset, strategy, page):
    def body(h: SchedulerHarness, spec: bool) -> list[list[Output]]:
        turns = _turns(h)
        if spec:
            stats = h.sched.spec.stats
            # Turn 2's greedy requests repeat turn 1: most of their drafts are accepted (measured:
            # ~320 of ~960 tokens committed come from accepted drafts).
            assert stats["accepted_tokens"] >= 100, stats
            assert stats["committed_tokens"] > stats["verify_steps"], stats
        h.flush_and_check_empty()
        return turns

    results = _plain_and_ngram(body, preset, strategy, page)
    for turn, (plain, spec) in enumerate(zip(results[False], results[True], strict=True)):
        for k, (a, b) in enumerate(zip(plain, spec, strict=True)):
            _assert_same(a, b, f"turn {turn + 1}, request {k}")
    # Turn 3 hits past a turn-1 prompt (no_buffer: the final states; extra buffer: a decode snapshot),
    # so it continues from a state a verify left.
    assert any(o.cached_tokens > 40 + 17 * k for k, o in enumerate(results[True][2]))


@pytest.mark.parametrize("preset", per_commit_cases([QWEN, NEMO], [QWEN]))  # (Nemotron-H: nightly full matrix)
def test_graph_shaped_verifies_give_the_same_outputs(preset, monkeypatch):
    """Where a CUDA graph serves verifies, every request runs --speculative-num-draft-tokens positions
    (its drafts, then filler never accepted) in a batch of fixed shape whose metadata comes from device
    tensors alone. On CPU the graph runner runs its captured bodies eagerly (`use_graphs=False`; a body
    that read a host list would fail its capture) with the Triton attention interpreted: three
    requests (bucket 4: one padded request), one penalized, one with top logprobs, every verify through
    the runner, and the same outputs and hits as plain decoding."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    width = SPEC["speculative_num_draft_tokens"]
    replays: list[tuple[str, int]] = []

    def body(h: SchedulerHarness, spec: bool) -> list[Output]:
        if spec:
            runner = h.sched.model_runner
            graphs = CudaGraphRunner(runner, [1, 2, 4], use_graphs=False, verify_width=width)
            runner.graph_runner = graphs
            assert graphs.verify_max_bs() == 4
            # One position per request is a decode: no verify graph (nor verify) at that width.
            assert CudaGraphRunner(runner, [1], use_graphs=False, verify_width=1).verify_max_bs() == 0
            replay = graphs.replay
            graphs.replay = lambda fb: replays.append((fb.forward_mode.name, fb.batch_size)) or replay(fb)
        prompt = token_ids(40, seed=3)
        first = h.generate(prompt, 30)
        assert h.sched.flush_cache()[0]
        rids = [
            h.submit(prompt, 30),
            h.submit(prompt, 24, frequency_penalty=0.5),
            h.submit(prompt + first.output_ids[:4], 20, top_logprobs_num=2),
        ]
        h.run()
        h.sched.check_integrity()
        outs = [first] + [h.outputs[r] for r in rids]
        turn2 = prompt + first.output_ids + token_ids(3, seed=4)  # hits what a verify left
        outs.append(h.generate(turn2, 6))
        h.flush_and_check_empty()
        return outs

    config = (preset, "extra_buffer", 16)
    outs = _plain_and_ngram(body, *config, attention_backend="triton", mamba_track_interval=64)
    for k, (a, b) in enumerate(zip(outs[False], outs[True], strict=True)):
        _assert_same(a, b, f"request {k}")
    assert outs[True][-1].cached_tokens >= 64  # the decode snapshot at 64
    verifies = [bs for mode, bs in replays if mode == "TARGET_VERIFY"]
    assert 3 in verifies and len(verifies) >= 8, replays  # the three requests' steps, padded to 4


def test_a_verify_is_graph_shaped_only_where_a_graph_and_the_free_pages_serve_it():
    """The filler's KV is given back at the commit, so padding a verify to the graphs' width must not evict
    cached prefixes: it pads only where the free pages hold every request's `width` positions, within its
    context and the captured sizes; else the verify runs eagerly, unpadded."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
    from sglang.srt.speculative.ngram_worker import NgramWorker

    allocator = PagedTokenAllocator(64, page_size=4)  # 16 pages
    graphs = SimpleNamespace(verify_width=6, verify_max_bs=lambda: 4)
    deps = SimpleNamespace(graph_runner=lambda: graphs, token_allocator=allocator, context_len=100)
    worker = SimpleNamespace(deps=deps)
    reqs = [SimpleNamespace(kv_len=n) for n in (10, 21, 40)]  # 6 positions take 1, 1 and 2 more pages

    def width(reqs) -> int:
        return NgramWorker._graph_width(worker, reqs)

    assert width(reqs) == 6
    allocator.alloc_pages(12)  # 4 pages left: just enough
    assert width(reqs) == 6
    allocator.alloc_pages(1)  # 3 left: the eager verify's own pages may still fit, evicting nothing
    assert width(reqs) == 0
    assert width(reqs[:2]) == 6
    assert width([SimpleNamespace(kv_len=95)]) == 0  # past its context
    assert width(reqs * 2) == 0  # more requests than the largest verify graph
    deps.graph_runner = lambda: None
    assert width(reqs[:1]) == 0


def test_finish_inside_accepted_drafts_keeps_the_finishing_state():
    """A stop token in the middle of a run of accepted drafts: the tokens after it are dropped, the KV and
    the running state end at it, and the next turn, which hits that final state, continues exactly."""

    def body(h: SchedulerHarness, spec: bool) -> tuple[Output, Output]:
        prompt = token_ids(50, seed=7)
        first = h.generate(prompt, 40)
        k = next(i for i in range(8, 40) if first.output_ids[i] not in first.output_ids[:i])
        stop = h.generate(prompt, 40, stop_token_ids=[first.output_ids[k]])
        assert stop.output_ids == first.output_ids[: k + 1]
        follow = h.generate(prompt + stop.output_ids + token_ids(3, seed=8), 20)
        h.sched.check_integrity()
        if spec:
            assert h.sched.spec.stats["accepted_tokens"] > k // 2  # the stop came inside accepted runs
        h.flush_and_check_empty()
        return stop, follow

    outs = _plain_and_ngram(body)
    for a, b in zip(outs[False], outs[True], strict=True):
        _assert_same(a, b, "stop / follow-up")
    # The follow-up hits the whole finished request (its last token has no KV yet): its final state.
    assert outs[True][1].cached_tokens == 50 + len(outs[True][0].output_ids) - 1


def test_a_penalized_request_verifies_its_newest_token_alone():
    """Penalties read a request's counts so far, so a penalized request gets no drafts: its one position
    is penalized (counts, a ban under min_new_tokens, a bias) as in a decode step, beside requests whose
    drafts are accepted. Every output is the same as plain decoding's."""

    def body(h: SchedulerHarness, spec: bool) -> list[Output]:
        prompt = token_ids(30, seed=3)
        first = h.generate(prompt, 40)
        rids = [
            h.submit(prompt, 40),
            h.submit(prompt, 40, frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.2),
            h.submit(prompt, 30, min_new_tokens=20, stop_token_ids=first.output_ids[5:6],
                     logit_bias={str(first.output_ids[3]): -5.0}),
        ]  # fmt: skip
        h.run()
        h.sched.check_integrity()
        if spec:
            assert h.sched.spec.stats["accepted_tokens"] >= 30, h.sched.spec.stats  # the plain request's
        return [h.outputs[r] for r in rids]

    outs = _plain_and_ngram(body)
    for k, (a, b) in enumerate(zip(outs[False], outs[True], strict=True)):
        _assert_same(a, b, f"request {k}")
    assert outs[True][1].output_ids != outs[True][0].output_ids  # the penalties changed the text


def test_a_request_drafts_again_once_its_penalties_are_spent():
    """min_new_tokens alone: while it holds, the request's stop ids are banned and it gets no drafts (here
    it has none to ban, `ignore_eos` without stop ids: the batch's penalty info is empty); after it, the
    request drafts like any other. The same tokens as plain decoding."""

    def body(h: SchedulerHarness, spec: bool) -> list[Output]:
        prompt = token_ids(30, seed=12)
        h.generate(prompt, 30)
        before = dict(h.sched.spec.stats) if spec else None
        rid = h.submit(prompt, 30, min_new_tokens=6)
        h.run()
        h.sched.check_integrity()
        if spec:  # its drafts from the first run were accepted after its sixth token
            assert h.sched.spec.stats["accepted_tokens"] > before["accepted_tokens"]
        return h.outputs[rid]

    outs = _plain_and_ngram(body)
    _assert_same(outs[False], outs[True], "min_new_tokens")


def test_a_request_whose_drafts_are_rejected_drafts_less_often():
    """Drafts that are always wrong (a token the model does not produce here): after k rejected verifies
    in a row the request drafts again only 2^k tokens later, so 64 tokens take ~6 verifies, not 63, and
    the other steps decode plainly; the tokens are plain decoding's."""

    def body(h: SchedulerHarness, spec: bool) -> Output:
        if spec:
            # <|im_start|>: never sampled here
            h.sched.spec.cache.draft = lambda tokens, n, seed=0: [1] * min(n, 3)
        out = h.generate(token_ids(30, seed=13), 64)
        if spec:
            stats = h.sched.spec.stats
            assert stats["accepted_tokens"] == 0 and 4 <= stats["verify_steps"] <= 8, stats
        return out

    outs = _plain_and_ngram(body)
    _assert_same(outs[False], outs[True], "rejected drafts")


def test_kv_pressure_retracts_and_outputs_stay_the_same():
    outs = {}
    for spec in (False, True):
        h = churn_harness(False, **(SPEC if spec else {}))
        try:
            rids = run_churn(h, abort_at=10_000)  # no abort: every request's output is compared
            assert h.sched.counters["num_retractions_total"] > 0
            h.sched.check_integrity()
            outs[spec] = [h.outputs[r].output_ids for r in rids]
            h.flush_and_check_empty()
        finally:
            h.shutdown()
    assert outs[True] == outs[False]


def test_flags():
    args = ServerArgs(model_path=QWEN, speculative_algorithm="NGRAM")
    assert args.speculative_num_draft_tokens == args.speculative_ngram_max_match_window_size == 12
    assert not args.enable_overlap_schedule  # verify results are read on the host before the next build
    assert args.mamba_scheduler_strategy == "extra_buffer"  # auto without overlap
    bad = {
        "--speculative-algorithm EAGLE3 needs a separate draft model": dict(speculative_algorithm="EAGLE3"),
        "--speculative-ngram-match-type PROB": dict(speculative_ngram_match_type="PROB"),
        "--speculative-ngram-min-match-window-size 5 exceeds": dict(
            speculative_ngram_min_match_window_size=5, speculative_ngram_max_match_window_size=4
        ),
        "--speculative-num-draft-tokens must be a positive": dict(speculative_num_draft_tokens=0),
        "--mamba-track-interval 64 must be at least --speculative-num-draft-tokens 65": dict(
            speculative_num_draft_tokens=65, mamba_track_interval=64
        ),
    }
    for message, flags in bad.items():
        flags.setdefault("speculative_algorithm", "NGRAM")
        with pytest.raises(ServerArgsError, match=message):
            ServerArgs(model_path=QWEN, **flags)


def test_verify_rows_come_out_of_a_derived_state_budget():
    """Without --max-mamba-cache-size the verify rows (D per running request) are paid from the state
    budget: the running cap shrinks so that the slots left still hold every running request (at the
    default 2% of a 1 GiB host this once left no slots and refused to start)."""
    from sglang.srt.mem_cache.pool_sizing import CPU_DEFAULT_MEM_FRACTION, compute_pool_sizes

    spec, plain = ServerArgs(model_path=QWEN, **SPEC), ServerArgs(model_path=QWEN)
    arch, memory = plain.model_config.arch, 1 << 30
    a, b = (compute_pool_sizes(args, arch, 0, device_memory=memory) for args in (spec, plain))
    rows = a.max_running_requests * SPEC["speculative_num_draft_tokens"]
    assert a.max_total_tokens == b.max_total_tokens
    assert a.max_mamba_cache_size + rows <= b.max_mamba_cache_size
    assert a.max_mamba_cache_size >= a.max_running_requests * spec.mamba_strategy.slots_per_running_req
    used = (a.max_mamba_cache_size + rows) * a.mamba_bytes_per_slot + a.max_total_tokens * a.kv_bytes_per_token
    assert used <= memory * CPU_DEFAULT_MEM_FRACTION
    # Slots given, tokens derived: the rows of as many requests as the slots hold are paid first.
    given = ServerArgs(model_path=QWEN, **SPEC, max_mamba_cache_size=a.max_mamba_cache_size)
    c = compute_pool_sizes(given, arch, 0, device_memory=memory)
    rows = c.max_running_requests * SPEC["speculative_num_draft_tokens"]
    used = (c.max_mamba_cache_size + rows) * c.mamba_bytes_per_slot + c.max_total_tokens * c.kv_bytes_per_token
    assert c.max_mamba_cache_size == a.max_mamba_cache_size and used <= memory * CPU_DEFAULT_MEM_FRACTION


def test_steps_without_logprobs_finish_on_time():
    """Without logprobs, plain steps between verifies log their tokens instead of committing them
    (`DecodeTokenLog`) while it counts that no request can finish; a verify commits tokens outside those
    counts, so it must end the log's run, or a request runs past its max_new_tokens unchecked (and then
    never finishes). 2-grams and longer only: drafts are rare in the first round (plain steps, logged)
    and every step of the second has them (it repeats the first). The logs' invariants hold after
    every step."""

    def body(h: SchedulerHarness, spec: bool) -> list[Output]:
        prompts = [token_ids(30 + 9 * k, seed=20 + k) for k in range(3)]
        for _ in range(2):
            rids = [h.submit(p, 40 + 5 * k, return_logprob=False) for k, p in enumerate(prompts)]
            while h.sched.step():
                h.sched.result_processor.token_log.check()
                h.sched.kv_log.check()
            h.collect()
            h.sched.check_integrity()
        if spec:
            assert h.sched.spec.stats["accepted_tokens"] > 0
            # The log ran between verifies (unless the decode fast path is off: the nightly run).
            assert h.sched.result_processor.token_log.steps_logged > 0 or not h.sched.fast_path.enabled
        return [h.outputs[r] for r in rids]

    outs = _plain_and_ngram(body, speculative_ngram_min_match_window_size=2)
    for k, (a, b) in enumerate(zip(outs[False], outs[True], strict=True)):
        assert len(b.output_ids) == 40 + 5 * k and b.finished_reason["type"] == "length"
        assert b.output_ids == a.output_ids


def test_a_processed_verify_leaves_the_running_slot_current():
    """Between steps a running slot holds the state after the request's KV, as after plain decode steps:
    the commit's copies run before the scheduler does anything else (a PD decode server may hand a slot
    given back to a transfer, which writes it from outside the forward stream). Checked against an
    independent runner's prefill of the same tokens, after every verify of a request whose drafts are
    accepted, with the radix cache off (as on a PD decode server)."""
    h = _harness(QWEN, "no_buffer", 1, True, disable_radix_cache=True)
    ref = RunnerDriver(make_runner(QWEN))
    try:
        prompt = token_ids(40, seed=4)
        h.generate(prompt, 30)
        rid = h.submit(prompt, 30)  # drafts from the first run: accepted
        checked, verifies = 0, 0
        while h.sched.step():
            req = h.sched.reqs_by_rid.get(rid)
            now = h.sched.spec.stats["verify_steps"]
            if req is None or now == verifies:
                continue
            verifies = now
            r = ref.new_request()
            ref.extend([Extend(r, req.all_ids[: req.kv_len])], return_logprob=False)
            want, got = pool_state(ref.runner, r.mamba_pool_idx), pool_state(h.sched.model_runner, req.mamba_pool_idx)
            for layer, state in want.items():
                for w, g in ((state.conv, got[layer].conv), (state.ssm, got[layer].ssm)):
                    # Prefill (chunked form) against decode steps: ~1e-6 apart (measured); the state
                    # before the verify is off by whole tokens.
                    assert (g - w).abs().max().item() <= 1e-4 * max(w.abs().max().item(), 1.0)
            ref.free(r)
            checked += 1
        assert checked >= 3
    finally:
        h.shutdown()


def test_more_running_requests_than_verify_rows_decode_plainly():
    """The verify rows are sized by the running cap; should more requests run (a PD decode server admits
    transfers beside a chunked prefill), the step decodes plainly instead of writing past them."""
    h = _harness(QWEN, "extra_buffer", 1, True, max_running_requests=3)
    try:
        prompt = token_ids(30, seed=6)
        first = h.generate(prompt, 20)
        pool = h.sched.req_to_token_pool.mamba_pool
        pool.verify_shape = (2, pool.verify_shape[1])  # rows for two of the three that run at once
        rids = [h.submit(prompt, 20) for _ in range(3)]
        before = h.sched.spec.stats["verify_steps"]
        h.run()
        assert h.sched.spec.stats["verify_steps"] == before
        assert all(h.outputs[r].output_ids == first.output_ids for r in rids)
        h.sched.check_integrity()
    finally:
        h.shutdown()


def test_the_decode_log_line_shows_the_accept_length(caplog):
    h = _harness(QWEN, "extra_buffer", 1, True, decode_log_interval=1)
    try:
        prompt = token_ids(30, seed=9)
        h.generate(prompt, 30)
        with caplog.at_level(logging.INFO, logger="sglang.srt.managers.scheduler"):
            h.generate(prompt, 30)  # drafts from the first run: several tokens per verify
        found = (re.search(r"accept len: ([0-9.]+)", r.getMessage()) for r in caplog.records)
        lens = [float(m.group(1)) for m in found if m]
        assert lens and max(lens) > 1.5, [r.getMessage() for r in caplog.records]
    finally:
        h.shutdown()


# On CUDA: Triton attention's extend over the cached prefix and the Triton decode steps on the verify rows,
# against plain decoding with its CUDA graphs. Float32 dots are IEEE there (test_strategy_matrix.py's
# GPU_ORACLE_TOL: 7.7e-6 measured against the oracle on an H200); 1e-3 is 100x below a wrong state.
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset,strategy,page", [(QWEN, "extra_buffer", 16), (NEMO, "extra_buffer", 1)])
def test_gpu_same_outputs_and_hits_as_plain_decoding(preset, strategy, page):
    """On CUDA, float32, with CUDA graphs: decode steps and verifies replay captured graphs (verifies of
    --speculative-num-draft-tokens positions per request), and the outputs are plain decoding's."""
    verifies: list[int] = []

    def body(h: SchedulerHarness, spec: bool) -> list[list[Output]]:
        if spec:
            graphs = h.sched.model_runner.graph_runner
            assert graphs.use_graphs and graphs.verify_max_bs() >= 4, "verify graphs were captured"
            replay = graphs.replay
            graphs.replay = lambda fb: fb.forward_mode.is_target_verify() and verifies.append(1) or replay(fb)
        turns = _turns(h)
        if spec:
            assert h.sched.spec.stats["accepted_tokens"] >= 100, h.sched.spec.stats
        h.flush_and_check_empty()
        return turns

    results = _plain_and_ngram(body, preset, strategy, page, device="cuda", dtype="float32")
    assert len(verifies) >= 20  # every verify step of the four requests replayed a graph
    for turn, (plain, spec) in enumerate(zip(results[False], results[True], strict=True)):
        for k, (a, b) in enumerate(zip(plain, spec, strict=True)):
            assert b.output_ids == a.output_ids and b.cached_tokens == a.cached_tokens, (turn, k)
            assert max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)), default=0) <= 1e-3


def test_stop_regexes_and_stop_lists_end_where_plain_decoding_ends_them():
    """Requests with a stop_regex, a charged stop list (more than 16 strings) and a few stop strings,
    each matching text inside what NGRAM's drafts predict: the outputs and finishes are plain decoding's,
    and in the NGRAM run every check of a verify's tokens took the measure of its step's one precheck
    (`FinishChecker.precheck`, `several`): none measured and agreed alone (before: each token after a
    request's first in a verify)."""
    import re as regex_module

    from sglang.srt.constrained.stop_strings import CHARGED_STOPS

    prompt = token_ids(50, seed=21)

    def body(h: SchedulerHarness, spec: bool) -> list[Output]:
        first = h.generate(prompt, 40)  # (its text is what the requests below draft from)
        text = h.sched.finisher.tokenizer.decode(first.output_ids[20:22])
        filler = [f"\x00{i}" for i in range(CHARGED_STOPS)]
        alone = h.sched.finisher.alone
        rids = [
            h.submit(prompt, max_new_tokens=40, stop_regex=[regex_module.escape(text)]),
            h.submit(prompt, max_new_tokens=40, stop=[*filler, text]),
            h.submit(prompt, max_new_tokens=40, stop=[text]),
            h.submit(prompt, max_new_tokens=40, stop_regex=["\x00never"]),
        ]
        h.run()
        h.sched.check_integrity()
        if spec:
            assert h.sched.spec.stats["accepted_tokens"] >= 20, "the requests' drafts were accepted"
            assert h.sched.finisher.alone == alone, "a verify's later tokens were measured alone"
        return [h.outputs[r] for r in rids]

    outs = _plain_and_ngram(body)
    for k, (a, b) in enumerate(zip(outs[False], outs[True], strict=True)):
        _assert_same(a, b, f"request {k}")
    assert all(o.finished_reason["type"] == "stop" for o in outs[True][:3])
    assert len(outs[True][0].output_ids) <= 22 and outs[True][3].finished_reason["type"] == "length"
    # EAGLE / NEXTN (MTP) verifies commit through the same code.
    from sglang.srt.speculative.eagle_worker import EagleWorker
    from sglang.srt.speculative.ngram_worker import NgramWorker

    assert EagleWorker.process_batch_result_verify is NgramWorker.process_batch_result_verify


def test_a_verify_commits_fewer_tokens_where_the_output_checks_budget_is_spent(monkeypatch):
    """Four stop_regex requests whose searches cost 2 ms each (a fake clock) under a 12 ms step budget:
    plain decoding's steps fit it (8 ms); a verify's tokens after each request's first fit only the 4 ms
    left, so the verify commits fewer of its accepted drafts than it would without the budget
    (`FinishChecker.verify_tokens`): the tokens it leaves are sampled again at the next step, and every
    output is still plain decoding's, with no request ended."""
    from sglang.test.fake_stop_search import fake_stop_search

    fake_stop_search(monkeypatch, lambda pattern, text, limit: 0.002)  # (cut where less is left)
    prompts = [token_ids(30 + 5 * k, seed=40 + k) for k in range(4)]

    def run(spec: bool, per_step: float) -> tuple[list[Output], dict]:
        monkeypatch.setenv("SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP", str(per_step))
        h = _harness(QWEN, "extra_buffer", 1, spec)
        try:
            for p in prompts:  # (NGRAM's cache learns each output: the requests below draft it)
                h.generate(p, 40)
            rids = [h.submit(p, max_new_tokens=40, stop_regex=["\x00never"]) for p in prompts]
            h.run()
            h.sched.check_integrity()
            stats = dict(h.sched.spec.stats) if spec else {}
            h.flush_and_check_empty()
            return [h.outputs[r] for r in rids], stats
        finally:
            h.shutdown()

    plain, _ = run(False, 0.012)
    free, free_stats = run(True, 0)  # (0: no step budget)
    tight, tight_stats = run(True, 0.012)
    for k in range(4):
        _assert_same(plain[k], free[k], f"request {k}, no budget")
        _assert_same(plain[k], tight[k], f"request {k}, 12 ms a step")
        assert tight[k].finished_reason == {"type": "length", "length": 40}
    assert tight_stats["accepted_tokens"] < free_stats["accepted_tokens"], (tight_stats, free_stats)
    assert tight_stats["accepted_tokens"] > 0


def test_a_grammar_or_custom_processor_request_gets_no_drafts():
    """What `FinishChecker.precheck` counts on for a verify's rows (a grammar's matcher takes back no
    token, so such a row is measured at its first token only): NGRAM's and EAGLE / NEXTN's drafting give a
    request with a grammar or a custom logit processor no drafts, while the same request without them,
    whose text repeats, gets some from NGRAM's cache."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative.eagle_worker import EagleWorker
    from sglang.srt.speculative.ngram_cache import NgramCache
    from sglang.srt.speculative.ngram_worker import NgramWorker

    ngram = NgramWorker.__new__(NgramWorker)
    ngram.width, ngram._histories, ngram._backoff = 4, {}, {}
    ngram.cache = NgramCache(1, 4, 8, 1000)
    ngram.deps = SimpleNamespace(context_len=4096)
    eagle = EagleWorker.__new__(EagleWorker)
    eagle.steps, eagle.deps, eagle._restash = 3, SimpleNamespace(context_len=4096), set()
    for kind in ("none", "grammar", "processor"):
        req = Req(kind, [5, 6, 7, 8] * 4, SamplingParams(max_new_tokens=100))
        if kind == "grammar":
            req.grammar = SimpleNamespace(terminated=False)
        elif kind == "processor":
            req.custom_logit_processor = object()
        drafts, mtp = ngram._draft(req), eagle._drafts_for(req)
        assert (drafts == []) == (kind != "none") and mtp == (kind == "none"), (kind, drafts, mtp)
