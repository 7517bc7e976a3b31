"""Rank functions for `sglang.test.multi_rank.run_ranks` that drive the scheduler's output checks
(`managers/finish_checker.py`) and grammar queue (`scheduler_components/grammar_queue.py`) on gloo ranks,
with facts that differ between the ranks (a grammar's or a search's time, a processor's failure, a
compile's outcome). Each returns plain values: what each request ended with, and the collectives run."""

from __future__ import annotations

import time
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

STEPS = 6


class _Collectives:
    """Counts this process's all-reduces and object gathers (the finisher and the queue call them through
    `torch.distributed`'s module attributes)."""

    def __init__(self):
        import torch.distributed as dist

        self.dist = dist
        self.real = (dist.all_reduce, dist.all_gather_object)
        self.all_reduce = self.gather = 0

        def all_reduce(*args, **kwargs):
            self.all_reduce += 1
            return self.real[0](*args, **kwargs)

        def all_gather_object(*args, **kwargs):
            self.gather += 1
            return self.real[1](*args, **kwargs)

        dist.all_reduce, dist.all_gather_object = all_reduce, all_gather_object

    def restore(self) -> None:
        self.dist.all_reduce, self.dist.all_gather_object = self.real


def _checker(group: Any):
    from sglang.srt.constrained.output_check_budget import OutputCheckBudget
    from sglang.srt.managers.finish_checker import FinishChecker

    c = FinishChecker(set(), 4096, tokenizer=SimpleNamespace(decode=lambda ids, **kw: "x" * len(ids)))
    # (a step's budget far above the requests': every allowance is the request's own 50 ms)
    c.budget = OutputCheckBudget(per_request_s=0.05, per_step_s=10.0)
    c.group = group
    return c


def _requests(rank: int) -> list:
    """The batch: a grammar over its allowance from its second token on rank 1 only, a cheap grammar, a
    stop_regex whose search is cut on rank 1 only (rank 0's finds its second pattern at once), one that
    matches at the third token, a custom logit processor that fails at the second token on rank 1 only,
    and a plain request."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    def grammar(costs: list[float]) -> SimpleNamespace:
        g = SimpleNamespace(terminated=False, stopped=False, accepted=0, fed=0)

        def catch_up(ids):
            g.fed += len(ids) - g.accepted
            g.accepted = len(ids)

        g.catch_up, g.take_spent = catch_up, lambda: costs.pop(0)
        return g

    def req(rid: str, **params) -> Req:
        return Req(rid, [5], SamplingParams(max_new_tokens=STEPS, **params))

    over = req("g_over", ebnf='root ::= "a"')
    over.grammar = grammar([0.001] + [0.06 if rank == 1 else 0.001] * STEPS)
    cheap = req("g_cheap", ebnf='root ::= "a"')
    cheap.grammar = grammar([0.001] * (STEPS + 1))
    failing = req("c_fail")
    failing.custom_logit_processor = object()  # (its failure is what is checked, not the processor)
    return [
        over,
        cheap,
        req("r_cut", stop_regex=["y", "x"]),
        req("r_match", stop_regex=["x{3}"]),
        failing,
        req("p"),
    ]


def _run(rank: int, group: Any, batched: bool, calls: _Collectives) -> dict:
    """Run the batch for STEPS tokens: each step's checks measured at once (`precheck`) or each alone.
    Per request: (output length, finish reason); per step: the all-reduces it ran."""
    c = _checker(group)
    reqs = _requests(rank)
    ended: dict[str, Any] = {}
    per_step = []
    for step in range(1, STEPS + 1):
        live = [r for r in reqs if r.finished_reason is None]
        if step == 2 and rank == 1:  # (as `Scheduler.process_oldest` copies this rank's processor errors)
            live[
                [r.rid for r in live].index("c_fail")
            ].custom_logit_error = "The custom_logit_processor failed: rank 1."
        before = calls.all_reduce
        if batched:
            c.precheck([(r, 7) for r in live])
        for r in live:
            r.output_ids.append(7)
            c.check_finished(r)
            if r.finished_reason is not None:
                ended[r.rid] = (len(r.output_ids), r.finished_reason)
        c.clear_prechecks()
        per_step.append(calls.all_reduce - before)
    fed = {r.rid: r.grammar.fed for r in reqs if r.grammar is not None}
    return {"ended": ended, "all_reduces": per_step, "alone": c.alone, "grammar_fed": fed}


def batch_output_checks(rank: int, world_size: int, init_method: str) -> dict:
    """The batch of `_requests` with its checks agreed once per step, then each check alone (the fallback,
    as before batches were measured together); then a grammar queue whose compile of one request fails
    on rank 1 only."""
    import torch.distributed as dist

    from sglang.srt.constrained import stop_search as search

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)), backend="gloo")
    calls = _Collectives()
    real = search._first_match

    def first_match(patterns, text, limit):
        if rank == 1 and patterns == ["y", "x"]:
            raise search.StopRegexTimeout(patterns[1], limit, 1)  # (as a loaded rank's `regex` timeout would)
        return real(patterns, text, limit)

    search._first_match = first_match
    try:
        out = {"batched": _run(rank, group, True, calls)}
        gathers = calls.gather
        out["batched"]["gathers"] = gathers
        out["alone"] = _run(rank, group, False, calls)
        out["grammar_queue"] = _compile_outcomes(rank, group, calls)
        out["refusal_and_overrun"] = _refusal_and_overrun(rank, group, search)
        out["verify"] = _verify_step(rank, group, search, real, calls)
        return out
    finally:
        search._first_match = real
        calls.restore()
        dist.destroy_process_group()


def _refusal_and_overrun(rank: int, group: Any, search: Any) -> dict:
    """Two requests over four tokens, each check measured in its batch: a grammar that refuses the second
    token on rank 1 only (a matcher of another build), and a stop_regex whose search on rank 1 only takes
    80 ms at the second token without being cut (rank 0's: 1 ms), then is cut at the third. What each
    ended with (output length, finish), on this rank."""
    from sglang.srt.constrained.xgrammar_backend import GrammarRejectedToken
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    now = [0.0]
    real_clock, real_match = search.clock, search._first_match

    def first_match(patterns, text, limit):
        n = len(text)  # (the stand-in tokenizer decodes one character per token)
        if rank == 1 and n == 2:
            now[0] += 0.08
        elif rank == 1 and n == 3:
            now[0] += limit
            raise search.StopRegexTimeout(patterns[0], limit, 0)
        else:
            now[0] += 0.001
        return None

    refusing = Req("g_refuse", [5], SamplingParams(max_new_tokens=4, ebnf='root ::= "a"'))
    g = SimpleNamespace(terminated=False, stopped=False, accepted=0)

    def catch_up(ids):
        if rank == 1 and len(ids) == 2:
            raise GrammarRejectedToken(f"token {ids[-1]}")
        g.accepted = len(ids)

    g.catch_up, g.take_spent = catch_up, lambda: 0.001
    refusing.grammar = g
    reqs = [refusing, Req("r_slow", [5], SamplingParams(max_new_tokens=4, stop_regex=["z"]))]
    search.clock, search._first_match = (lambda: now[0]), first_match
    try:
        c = _checker(group)
        ended: dict[str, Any] = {}
        for _ in range(4):
            live = [r for r in reqs if r.finished_reason is None]
            c.precheck([(r, 7) for r in live])
            for r in live:
                r.output_ids.append(7)
                c.check_finished(r)
                if r.finished_reason is not None:
                    ended[r.rid] = (len(r.output_ids), r.finished_reason)
            c.clear_prechecks()
        return ended
    finally:
        search.clock, search._first_match = real_clock, real_match


def _verify_step(rank: int, group: Any, search: Any, real_match: Any, calls: _Collectives) -> dict:
    """One NGRAM verify step's commit (`NgramWorker.process_batch_result_verify`, the scheduler's pools
    stubbed) of stop_regex requests that accept both their drafts (three tokens each to commit): one
    whose pattern matches at its second token, one whose search is cut at its first token on rank 1
    only (rank 0's finds "x" there at once), one whose search is cut at its second token on rank 1 only,
    four that never match, one that samples a stop token id as its second, one without drafts, and a
    plain request. What each ended with and its output length, the all-reduces the step ran, and the
    finisher's counts."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.batch_result_processor import BatchResultProcessor
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.speculative import ngram_worker
    from sglang.srt.speculative.ngram_worker import NgramVerifyInput, NgramWorker

    def first_match(patterns, text, limit):
        # (the stand-in tokenizer decodes one "x" per token: the first token to commit makes 3 of them)
        if rank == 1 and patterns == ["y", "x"] and len(text) == 3:
            raise search.StopRegexTimeout(patterns[1], limit, 1)
        if rank == 1 and patterns == ["q"] and len(text) == 4:
            raise search.StopRegexTimeout(patterns[0], limit, 0)
        return real_match(patterns, text, limit)

    def req(rid: str, **params) -> Req:
        r = Req(rid, [5], SamplingParams(max_new_tokens=100, **params))
        r.output_ids = [7, 7]
        return r

    reqs = [
        req("r_match", stop_regex=["^x{4}$"]),
        req("r_cut", stop_regex=["y", "x"]),
        req("r_trunc", stop_regex=["q"]),
        *(req(f"r_far{k}", stop_regex=["z"]) for k in range(4)),
        req("r_stop_id", stop_regex=["z"], stop_token_ids=[8]),
        req("r_nodraft", stop_regex=["z"]),
        req("plain"),
    ]
    drafts = [[7, 7]] * 7 + [[7, 8], [], [7, 7]]
    sampled = [t for d in drafts for t in [*d, 7]]  # (every draft accepted, then the bonus token 7)
    c = _checker(group)
    log = SimpleNamespace(clear=lambda: None, take=lambda req=None: [])
    fast_path = SimpleNamespace(token_log=log, flush=lambda req=None: None, clear=lambda: None)
    rp = BatchResultProcessor(None, None, c, lambda out: None, lambda r: None, {}, 1, fast_path)
    rp.counters["num_generation_tokens_total"] = 0
    rp.settle, rp.stream_output = (lambda req, pending: None), (lambda reqs: None)  # (no pools to release)
    worker = NgramWorker.__new__(NgramWorker)
    worker._backoff, worker.stats = {}, {k: 0 for k in ("verify_steps", "draft_tokens", "accepted_tokens")}
    worker.stats["committed_tokens"] = 0
    pool = SimpleNamespace(mamba_pool=SimpleNamespace(verify_row=lambda i, t: 0))
    worker.deps = SimpleNamespace(
        result_processor=rp,
        req_to_token_pool=pool,
        token_allocator=None,
        copy_states=lambda copies: None,
        add_generated=lambda n: None,
    )
    widths = [len(d) + 1 for d in drafts]
    spec = NgramVerifyInput(drafts, [0] * len(reqs), [-1] * len(reqs), widths)
    batch = SimpleNamespace(reqs=reqs, spec_info=spec, measured_rows=None, pending_tracks={})
    result = SimpleNamespace(next_token_ids=sampled, hidden_states=None, next_token_logprobs=None)
    real_release, real_search = ngram_worker.release_verify_tail, search._first_match
    ngram_worker.release_verify_tail, search._first_match = (lambda *a: None), first_match
    before = calls.all_reduce
    try:
        worker.process_batch_result_verify(batch, result)
        c.clear_prechecks()
    finally:
        ngram_worker.release_verify_tail, search._first_match = real_release, real_search
    ended = {r.rid: (len(r.output_ids), r.finished_reason) for r in reqs}
    reduces = calls.all_reduce - before
    return {"ended": ended, "all_reduces": reduces, "agreements": c.agreements, "alone": c.alone}


def _compile_outcomes(rank: int, group: Any, calls: _Collectives) -> dict:
    """Two queued requests whose compiles rank 0's tick decides at once: "bad" fails to compile on rank 1
    only, "ok" compiles everywhere. What each rank ended and admitted, and the gathers it ran."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.grammar_queue import GrammarQueue
    from sglang.srt.sampling.sampling_params import SamplingParams

    def submit(kind: str, text: str) -> Future:
        fut: Future = Future()
        if text == "bad" and rank == 1:
            fut.set_exception(ValueError("unknown rule 'bad' on rank 1"))
        else:
            fut.set_result(text)
        return fut

    backend = SimpleNamespace(submit=submit, abandon=lambda fut: None, matcher=lambda compiled: compiled)
    errors, ready = {}, []
    queue = GrammarQueue(
        backend, lambda r: ready.append(r.rid), lambda r, m, f: errors.update({r.rid: (m, f)})
    )
    queue.group = group
    for rid in ("bad", "ok"):
        queue.add(Req(rid, [5], SamplingParams(ebnf=rid)))
    before = calls.gather
    queue.apply([("bad", False), ("ok", False)])
    return {"errors": errors, "ready": ready, "gathers": calls.gather - before, "held": queue.held}


def agreement_cost(rank: int, world_size: int, init_method: str, sizes: list[int], steps: int) -> dict:
    """Seconds per step of a batch's output checks with `n` constrained requests (cheap stand-in grammars:
    what the agreement costs, not the grammars), for each `n` in `sizes`: measured together and agreed
    once (`precheck`), and each check measured and agreed alone (the per-request agreement before)."""
    import torch.distributed as dist

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)), backend="gloo")
    try:
        out: dict[str, dict[int, float]] = {"batched": {}, "alone": {}}
        for n in sizes:
            for mode in ("alone", "batched"):
                c = _checker(group)
                reqs = []
                for i in range(n):
                    r = Req(f"r{i}", [5], SamplingParams(max_new_tokens=10**6, json_schema="{}"))
                    r.grammar = SimpleNamespace(
                        terminated=False,
                        stopped=False,
                        accepted=0,
                        catch_up=lambda ids: None,
                        take_spent=lambda: 0.0,
                    )
                    reqs.append(r)
                dist.barrier(group=group)
                start = time.perf_counter()
                for _ in range(steps):
                    if mode == "batched":
                        c.precheck([(r, 7) for r in reqs])
                    for r in reqs:
                        r.output_ids.append(7)
                        c.check_finished(r)
                    c.clear_prechecks()
                out[mode][n] = (time.perf_counter() - start) / steps
                assert all(r.finished_reason is None for r in reqs)
        return out
    finally:
        dist.destroy_process_group()


def verify_agreement_cost(
    rank: int, world_size: int, init_method: str, sizes: list[int], width: int, steps: int
) -> dict:
    """Per verify step of `n` stop_regex requests (a pattern that never matches on a stand-in tokenizer:
    what is timed is the agreement and the checks' logic) that each commit `width` tokens, for each `n` in
    `sizes`: seconds and all-reduces per step, with every token prechecked in one agreement (`several`,
    now) and with only each request's first token prechecked, each later token's check measured and
    agreed alone (before)."""
    import torch.distributed as dist

    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    group = dist.new_group(list(range(world_size)), backend="gloo")
    calls = _Collectives()
    try:
        out: dict[str, dict[int, tuple[float, float]]] = {"first": {}, "all": {}}
        tokens = [7] * width
        for n in sizes:
            for mode in ("first", "all"):
                c = _checker(group)
                params = SamplingParams(max_new_tokens=10**6, stop_regex=["z"])
                reqs = [Req(f"r{i}", [5], params) for i in range(n)]
                dist.barrier(group=group)
                before, start = calls.all_reduce, time.perf_counter()
                for _ in range(steps):
                    if mode == "all":
                        c.precheck([(r, tokens) for r in reqs], several=True)
                    else:
                        c.precheck([(r, tokens[0]) for r in reqs])
                    for r in reqs:
                        for token in tokens:
                            r.output_ids.append(token)
                            c.check_finished(r)
                    c.clear_prechecks()
                seconds = (time.perf_counter() - start) / steps
                out[mode][n] = (seconds, (calls.all_reduce - before) / steps)
                assert all(r.finished_reason is None for r in reqs)
        return out
    finally:
        calls.restore()
        dist.destroy_process_group()
