"""Constrained decoding (sglang/srt/constrained/) through the real scheduler, checked step by step against
the transformers oracle with a matcher of its own: each output token must be the argmax, and its
logprob the log-softmax, of the oracle's logits masked by xgrammar's own `apply_token_bitmask_inplace`
with the grammar fed the tokens before it; the request ends where the grammar completes. Batches mix
grammars of every kind with plain requests, with overlap on and off, chunked prefill, retraction and
NGRAM drafting; the refusals (no backend, a grammar that does not compile) and an abort while the
grammar compiles leave nothing behind."""

from __future__ import annotations

import json
import math
from concurrent.futures import Future

import pytest
import regex
import torch
import xgrammar as xgr

from sglang.srt.constrained.grammar_spec import structural_tag_grammar
from sglang.srt.managers.io_struct import BootstrapInfo
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import ORACLE_TOL, SchedulerHarness, churn_harness, token_ids

register_cpu_ci(est_time=60, suite="per-commit-cpu")

QWEN, NEMOTRON = "tiny-qwen3-next", "tiny-nemotron-h"
REGEX = r"[a-c]{2,6}x(yz)?"
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
EBNF = 'root ::= "yes" | "no" | "maybe " [0-9]'
TAG = {
    "type": "structural_tag",
    "structures": [{"begin": "<f>", "schema": {"properties": {"a": {"type": "integer"}}}, "end": "</f>"}],
    "triggers": ["<f"],
}
GRAMMARS = {
    "regex": REGEX,
    "json_schema": json.dumps(SCHEMA),
    "ebnf": EBNF,
    "structural_tag": json.dumps(TAG),
}


def oracle_compiler(h: SchedulerHarness) -> xgr.GrammarCompiler:
    """A compiler of the test's own, over the same tokenizer, vocabulary and end-of-sequence ids."""
    finisher = h.sched.finisher
    info = xgr.TokenizerInfo.from_huggingface(
        finisher.tokenizer,
        vocab_size=h.server_args.model_config.vocab_size,
        stop_token_ids=sorted(finisher.eos_token_ids),
    )
    return xgr.GrammarCompiler(info, max_threads=1)


def compile_for_oracle(compiler: xgr.GrammarCompiler, kind: str, text: str):
    if kind == "json_schema":
        return compiler.compile_json_schema(text)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "ebnf":
        return compiler.compile_grammar(text)
    return structural_tag_grammar(text, compiler)


def check_grammar_oracle(oracle, compiled, prompt: list[int], out, tol: float = ORACLE_TOL) -> None:
    """Greedy output under a grammar against the oracle (see the module docstring)."""
    n = len(prompt)
    logits = oracle.logits(prompt + out.output_ids)[n - 1 : n - 1 + len(out.output_ids)]
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, logits.shape[1])
    for t, token in enumerate(out.output_ids):
        matcher.fill_next_token_bitmask(bitmask)
        row = logits[t : t + 1].clone()
        xgr.apply_token_bitmask_inplace(row, bitmask)
        lp = row[0].log_softmax(-1)
        assert lp[token] >= lp.max() - tol, f"{out.rid} step {t}: {token} is not the masked argmax"
        assert abs(out.logprobs[t] - lp[token].item()) < tol, f"{out.rid} step {t}: logprob"
        assert matcher.accept_token(token), f"{out.rid} step {t}: the grammar does not allow {token}"
    if out.finished_reason["type"] == "stop":
        assert matcher.is_terminated(), f"{out.rid} stopped before its grammar completed"
    else:
        assert out.finished_reason["type"] == "length" and not matcher.is_terminated()


@pytest.mark.parametrize("preset", [QWEN, NEMOTRON])
@pytest.mark.parametrize("overlap", [True, False])
def test_every_grammar_kind_against_the_oracle(oracles, preset, overlap):
    h = SchedulerHarness(preset, disable_overlap_schedule=not overlap, chunked_prefill_size=64)
    _every_grammar_kind(h, oracles[preset], preset, ORACLE_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("preset", [QWEN, NEMOTRON])
def test_gpu_every_grammar_kind_against_the_oracle(oracles, preset):
    """On CUDA, float32, decode steps replaying CUDA graphs: the masks move with the batch and apply to
    the logits the graph wrote (the tolerance: test_strategy_matrix.GPU_ORACLE_TOL's reasons)."""
    h = SchedulerHarness(preset, chunked_prefill_size=64, device="cuda", dtype="float32")
    assert h.sched.model_runner.graph_runner.use_graphs
    _every_grammar_kind(h, oracles[preset], preset, 1e-3)


def _every_grammar_kind(h: SchedulerHarness, oracle, preset: str, tol: float) -> None:
    compiler = oracle_compiler(h)
    # One batch: a request per grammar kind, two plain ones, a prompt longer than a chunk (its first
    # chunk samples nothing), greedy.
    reqs = []
    for k, (kind, text) in enumerate(GRAMMARS.items()):
        prompt = token_ids(90 if k == 0 else 20 + 7 * k, seed=k)
        # (ebnf with ignore_eos: the grammar's completion alone ends it)
        rid = h.submit(prompt, max_new_tokens=40, ignore_eos=kind == "ebnf", **{kind: text})
        reqs.append((kind, text, prompt, rid))
    plain = [(token_ids(30 + k, seed=50 + k), k) for k in range(2)]
    plain_rids = [h.submit(p, max_new_tokens=12) for p, _ in plain]
    h.run()
    tokenizer = h.sched.finisher.tokenizer
    for kind, text, prompt, rid in reqs:
        out = h.outputs[rid]
        check_grammar_oracle(oracle, compile_for_oracle(compiler, kind, text), prompt, out, tol)
        if kind == "regex" and out.finished_reason["type"] == "stop":
            body = tokenizer.decode(out.output_ids[:-1])  # the grammar completes on the eos id
            assert regex.fullmatch(REGEX, body), body
    for k in (0, 2):  # the regex and ebnf languages are finite
        assert h.outputs[reqs[k][3]].finished_reason["type"] == "stop"
    for (prompt, _), rid in zip(plain, plain_rids, strict=True):
        assert h.outputs[rid].output_ids == oracle.greedy(prompt, 12)
    assert h.sched.grammar_queue.live == 0 and not h.sched.grammar_queue
    h.sched.check_integrity()
    h.flush_and_check_empty()
    h.shutdown()


def test_mask_keeps_a_sampled_request_inside_its_grammar():
    """Sampling at temperature 1: every token stays inside the grammar (xgrammar's matcher accepts the
    whole output), with a seed the same tokens with overlap on and off."""
    outs = []
    for overlap in (True, False):
        h = SchedulerHarness(QWEN, disable_overlap_schedule=not overlap)
        rids = [
            h.submit(token_ids(25, seed=s), max_new_tokens=30, temperature=1.0, sampling_seed=s, regex=REGEX)
            for s in range(4)
        ]
        h.run()
        compiler = oracle_compiler(h)
        for rid in rids:
            matcher = xgr.GrammarMatcher(compiler.compile_regex(REGEX))
            assert all(matcher.accept_token(t) for t in h.outputs[rid].output_ids)
        outs.append([h.outputs[r].output_ids for r in rids])
        h.shutdown()
    assert outs[0] == outs[1]


def test_grammar_requests_survive_retraction(oracles):
    """A pool too small for the outputs: requests with a grammar are retracted, prefill their outputs
    again, and their matchers (which saw those tokens) go on where they were."""
    h = churn_harness(overlap=True)
    compiler = oracle_compiler(h)
    long_regex = r"[a-z ]{10,120}\."
    reqs = []
    for k in range(10):
        prompt = token_ids(10 + 9 * k, seed=k)
        kw = {"regex": long_regex} if k % 2 == 0 else {}
        reqs.append((prompt, kw, h.submit(prompt, max_new_tokens=70 + 5 * k, ignore_eos=False, **kw)))
    grammars = h.sched.grammar_queue
    while h.sched.step():
        grammars.check(h.sched.live_requests())  # queued + holding a matcher, at every step
        assert grammars.live <= 5
    h.collect()
    assert h.sched.counters["num_retractions_total"] > 0
    for prompt, kw, rid in reqs:
        out = h.outputs[rid]
        if kw:
            check_grammar_oracle(oracles[QWEN], compiler.compile_regex(long_regex), prompt, out)
        else:
            h.check_oracle(oracles[QWEN], prompt, out)
    h.sched.check_integrity()
    h.shutdown()


def test_ngram_verifies_beside_a_grammar_request(oracles):
    """NGRAM verifies of a drafting request and one with a grammar: the latter has one position, masked
    at its own logits row, and every output is the one without NGRAM."""
    prompt, letters = token_ids(40, seed=3), r"[a-z]{20,30}"
    spec = SchedulerHarness(QWEN, speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)
    plain = SchedulerHarness(QWEN)
    outs, verifies = [], []
    for h in (spec, plain):
        h.generate(prompt, max_new_tokens=40)  # its text is what the next request drafts from
        verifies.append(spec.sched.spec.stats["verify_steps"])
        rids = [h.submit(prompt, max_new_tokens=40)]
        rids.append(h.submit(token_ids(20, seed=9), max_new_tokens=30, regex=letters))
        h.run()
        outs.append([h.outputs[r].output_ids for r in rids])
    assert outs[0] == outs[1]
    assert spec.sched.spec.stats["verify_steps"] - verifies[0] >= 3, "the pair verified together"
    # The grammar request's checks (one token per verify or decode step) were each measured with their
    # batch's (`FinishChecker.precheck`: under TP one agreement per batch), none alone.
    for h in (spec, plain):
        assert h.sched.finisher.alone == 0 and h.sched.finisher.agreements > 0
    compiled = oracle_compiler(spec).compile_regex(letters)
    check_grammar_oracle(oracles[QWEN], compiled, token_ids(20, seed=9), spec.outputs[rids[1]])
    # The rule itself: a request whose history drafts gets none while it has a grammar.
    spec.submit(prompt, max_new_tokens=40)
    spec.sched.step()
    req = spec.sched.running[0] if spec.sched.running else spec.sched.waiting_queue[0]
    assert spec.sched.spec._draft(req), "its text is in the cache"
    req.grammar = plain.sched.grammar_queue.backend.matcher(compiled)
    assert spec.sched.spec._draft(req) == []
    req.grammar = None
    for h in (spec, plain):
        h.run()
        h.sched.check_integrity()
        h.shutdown()


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, sampling_seed=4)])
def test_a_grammar_that_must_end_wins_over_min_new_tokens(sampling):
    """min_new_tokens bans the end-of-sequence ids while the grammar allows nothing else: the grammar's
    tokens are taken (equally likely: the preset's end-of-sequence ids, each log(1/2)), never NaN or a
    token it refuses."""
    h = SchedulerHarness(QWEN)
    eos = sorted(h.sched.finisher.eos_token_ids)
    prompt = token_ids(10, seed=1)
    out = h.generate(prompt, max_new_tokens=8, regex="ab", min_new_tokens=6, ignore_eos=False, **sampling)
    assert out.finished_reason == {"type": "stop", "matched": out.output_ids[-1]}
    assert out.output_ids[-1] in eos
    assert all(lp == lp for lp in out.logprobs)  # (NaN != NaN)
    assert out.logprobs[-1] == pytest.approx(-math.log(len(eos)))
    h.shutdown()


def test_refusals_name_the_field_and_leave_nothing_behind():
    # No backend: a 400 naming the field, at once.
    h = SchedulerHarness(QWEN, grammar_backend="none")
    rid = h.submit(token_ids(10, seed=1), regex="a+")
    ok = h.submit(token_ids(10, seed=2))
    h.run()
    reason = h.outputs[rid].finished_reason
    assert (reason["type"], reason["status_code"], reason["param"]) == ("abort", 400, "regex")
    assert "--grammar-backend none" in reason["message"]
    assert h.outputs[ok].finished_reason["type"] == "length"
    h.flush_and_check_empty()
    h.shutdown()
    # A grammar that does not compile: the same, once the compile fails.
    h = SchedulerHarness(QWEN)

    def fail(kind: str, text: str):
        raise RuntimeError("[07:00:00] /project/cpp/x.cc:1: too large")

    h.sched.grammar_queue.backend.compile = fail
    rid = h.submit(token_ids(10, seed=1), ebnf='root ::= "a"')
    h.run()
    reason = h.outputs[rid].finished_reason
    assert (reason["status_code"], reason["param"]) == (400, "ebnf")
    assert reason["message"] == "ebnf could not be compiled: too large."
    assert h.sched.grammar_queue.live == 0
    h.flush_and_check_empty()
    h.shutdown()


def test_a_slow_grammar_holds_up_no_other_and_times_out(monkeypatch):
    """A grammar that never finishes compiling: a later request's grammar passes it, and it ends with a
    400 once SGLANG_GRAMMAR_TIMEOUT is past; nothing is left behind."""
    h = SchedulerHarness(QWEN)
    backend = h.sched.grammar_queue.backend
    pending: Future = Future()
    submit = backend.submit
    backend.submit = lambda kind, text: pending if text == "slow+" else submit(kind, text)
    slow = h.submit(token_ids(10, seed=1), regex="slow+")
    fast = h.submit(token_ids(10, seed=2), max_new_tokens=6, regex="[a-z]+")
    for _ in range(200):
        h.sched.step()
        h.collect()
        if h.outputs[fast].finished_reason is not None:
            break
    assert h.outputs[fast].finished_reason is not None and h.outputs[slow].finished_reason is None
    monkeypatch.setenv("SGLANG_GRAMMAR_TIMEOUT", "0")
    h.run()
    reason = h.outputs[slow].finished_reason
    assert (reason["status_code"], reason["param"]) == (400, "regex")
    assert "SGLANG_GRAMMAR_TIMEOUT" in reason["message"]
    assert h.sched.grammar_queue.live == 0 and pending.cancelled()
    h.flush_and_check_empty()
    h.shutdown()


def test_a_compiling_grammar_costs_the_others_no_overlap():
    """While a grammar compiles, plain requests decode with the overlap schedule (batch N + 1 launched
    before N is processed); once a request with a matcher runs, each batch is processed first."""
    h = SchedulerHarness(QWEN)
    pending: Future = Future()
    h.sched.grammar_queue.backend.submit = lambda kind, text: pending
    h.sched.record_events = True
    waiting = h.submit(token_ids(10, seed=1), regex="a+")
    h.submit(token_ids(10, seed=2), max_new_tokens=12)
    for _ in range(8):
        h.sched.step()
    events = h.sched.events
    overlapped = any(
        kind == "launch" and ("process", n - 1) in events[k + 1 :] for k, (kind, n) in enumerate(events)
    )
    assert overlapped, events
    h.sched.abort_request(waiting)
    h.run()
    h.flush_and_check_empty()
    h.shutdown()


def test_any_json_value():
    """Upstream's json_schema "$$ANY$$": any JSON value."""
    h = SchedulerHarness(QWEN)
    out = h.generate(token_ids(10, seed=3), max_new_tokens=30, json_schema="$$ANY$$", ignore_eos=False)
    matcher = xgr.GrammarMatcher(oracle_compiler(h).compile_builtin_json_grammar())
    assert all(matcher.accept_token(t) for t in out.output_ids)
    h.shutdown()


def test_abort_while_the_grammar_compiles():
    h = SchedulerHarness(QWEN)
    pending: Future = Future()
    h.sched.grammar_queue.backend.submit = lambda kind, text: pending
    rid = h.submit(token_ids(10, seed=1), json_schema='{"type": "string"}')
    h.sched.step()  # leaves it queued: its grammar is not ready
    assert len(h.sched.grammar_queue) == 1 and not h.sched.is_idle()
    h.sched.abort_request(rid)
    h.collect()
    assert h.outputs[rid].finished_reason["type"] == "abort"
    assert len(h.sched.grammar_queue) == 0 and h.sched.grammar_queue.live == 0 and h.sched.is_idle()
    assert pending.cancelled()
    h.flush_and_check_empty()
    h.shutdown()


def test_vocab_mask_unpacks_like_xgrammar():
    """The runtime's unpacking of the bits (torch only, any device) against xgrammar's own kernel, on
    random words (negative ones included) and a vocabulary that is not a multiple of 32."""
    from sglang.srt.constrained.vocab_mask import VocabMaskInfo, apply_vocab_mask

    g = torch.Generator().manual_seed(0)
    vocab = 77
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), generator=g, dtype=torch.int64).to(torch.int32)
    logits = torch.randn(5, vocab, generator=g)
    rows = torch.tensor([4, 0, 2])
    ours = apply_vocab_mask(logits.clone(), VocabMaskInfo(rows, bitmask))
    theirs, full = logits.clone(), torch.full((5, 3), -1, dtype=torch.int32)
    full[rows] = bitmask  # xgrammar's rows of the bits are the logits' rows
    xgr.apply_token_bitmask_inplace(theirs, full, indices=rows.tolist())
    assert torch.equal(ours, theirs)
    assert torch.isinf(ours[rows]).any() and torch.equal(ours[[1, 3]], logits[[1, 3]])


def test_a_first_token_from_a_prefill_server_the_grammar_refuses_names_the_flags():
    """A PD pair started with different grammar flags: the decode server's matcher refuses the token the
    prefill server sampled, and the error says what to make equal (else a bare 500)."""
    h = SchedulerHarness(QWEN)
    compiled = oracle_compiler(h).compile_regex("[a-z]+")
    eos = min(h.sched.finisher.eos_token_ids)  # (the regex needs a letter first)
    messages = []
    for bootstrap in (None, BootstrapInfo("10.0.0.1", 8998, "7")):
        req = Req(f"r{len(messages)}", [5, 6, 7], SamplingParams(max_new_tokens=8))
        req.bootstrap = bootstrap
        req.grammar = h.sched.grammar_queue.backend.matcher(compiled)
        req.output_ids.append(eos)
        h.sched.finisher.check_finished(req)
        assert req.finished_reason["status_code"] == 500
        messages.append(req.finished_reason["message"])
    assert "does not allow the token" in messages[0] and "prefill server" not in messages[0]
    assert "The prefill server sampled it" in messages[1]
    assert "--constrained-json-disable-any-whitespace" in messages[1]
    h.shutdown()
