"""A batch's output checks measured together (`FinishChecker.precheck`, managers/finish_checker.py): what
the scheduler runs at every batch, on one rank too (the ranks' agreement itself is
test/unit/distributed/test_tp_output_check_batch.py). Each row's check decides on its stored measure (the
grammar is fed each token once); a measure for another output length is not used; the stored measures
keep no request alive once the batch is processed; a request the budget already ended is not measured;
the batch's newcomers share the step's budget as when each was charged before the next was measured; and
`init_parallel` gives the finisher and the grammar queue the TP group they agree over."""

from __future__ import annotations

import math
import sys
from types import SimpleNamespace

import pytest

from sglang.srt.constrained import stop_search
from sglang.srt.constrained.output_check_budget import OutputCheckBudget
from sglang.srt.managers.finish_checker import FinishChecker
from sglang.srt.managers.output_view import Appended
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fake_stop_search import fake_stop_search

register_cpu_ci(est_time=1, suite="per-commit-cpu")


class _Grammar:
    """A stand-in matcher: counts the tokens it is fed; each check costs 1 ms."""

    def __init__(self):
        self.terminated = self.stopped = False
        self.accepted = self.fed = 0

    def catch_up(self, ids: list[int]) -> None:
        self.fed += len(ids) - self.accepted
        self.accepted = len(ids)

    def take_spent(self) -> float:
        return 0.001


def _grammar_req(rid: str) -> Req:
    req = Req(rid, [5], SamplingParams(ebnf='root ::= "a"', max_new_tokens=100))
    req.grammar = _Grammar()
    return req


def _checker() -> FinishChecker:
    c = FinishChecker(set(), 4096, tokenizer=SimpleNamespace(decode=lambda ids, **kw: "x" * len(ids)))
    c.budget = OutputCheckBudget(per_request_s=0.05, per_step_s=0.2)
    return c


def test_a_check_decides_on_its_batchs_measure_and_measures_only_a_stale_one_again():
    c = _checker()
    reqs = [_grammar_req(f"g{i}") for i in range(3)]
    for step in range(1, 4):
        c.precheck([(r, 7) for r in reqs])
        assert all(r.output_ids == [7] * (step - 1) for r in reqs)  # (the tokens went back out)
        for r in reqs:
            r.output_ids.append(7)
            c.check_finished(r)
        c.clear_prechecks()
    assert c.agreements == 3 and c.alone == 0  # one agreement per batch, none per check
    assert [r.grammar.fed for r in reqs] == [3, 3, 3]  # each token fed once
    # A measure taken at another output length (a verify's later token) is not used: measured again.
    req = reqs[0]
    c.precheck([(req, 7)])
    req.output_ids += [7, 7]
    c.check_finished(req)
    assert c.alone == 1 and req.grammar.fed == 5 and req.finished_reason is None


def test_the_stored_measures_keep_no_request_alive():
    """A request whose check never comes (it ended elsewhere while its batch was processed) is not held
    once the batch is processed: `process_batch_result` clears the measures, even when it raises."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import BatchResultProcessor

    c = _checker()
    req = _grammar_req("gone")
    refs = sys.getrefcount(req)
    c.precheck([(req, 7)])
    assert sys.getrefcount(req) > refs  # (held by the stored measure, until the batch is processed)

    def verify(batch, result):
        raise RuntimeError("the verify failed")

    rp = SimpleNamespace(finisher=c, process_verify=verify)
    batch = SimpleNamespace(forward_mode=SimpleNamespace(is_target_verify=lambda: True))
    with pytest.raises(RuntimeError):
        BatchResultProcessor.process_batch_result(rp, batch, None)
    assert sys.getrefcount(req) == refs and not c._measured


def test_a_request_the_budget_ended_is_not_measured():
    c = _checker()
    req = _grammar_req("ended")
    c.budget._ended[req] = "ebnf"  # (ended for the load by an earlier charge)
    c.precheck([(req, 7)])
    assert req.grammar.fed == 0 and c.agreements == 0
    req.output_ids.append(7)
    c.check_finished(req)
    assert req.finished_reason["param"] == "ebnf" and "among the costliest" in req.finished_reason["message"]


def test_a_batchs_newcomers_share_the_steps_budget(monkeypatch):
    """16 requests whose stop_regex search takes all the time it is given, measured in one batch: each is
    given what the batch's rows measured before it leave of the step (`PendingCharges`), as when each was
    charged before the next was checked, so the batch spends at most 1 + ln(16) step budgets (without it,
    16 allowances: 0.8 s here)."""
    fake_stop_search(monkeypatch, lambda pattern, text, limit: 2 * limit)  # (cut at every limit)
    c = _checker()
    c.budget = OutputCheckBudget(per_request_s=0.05, per_step_s=0.1)
    reqs = [Req(f"r{i}", [5], SamplingParams(stop_regex=["x"], max_new_tokens=100)) for i in range(16)]
    c.precheck([(r, 7) for r in reqs])
    assert stop_search.clock() <= 0.1 * (1 + math.log(16)), stop_search.clock()
    assert stop_search.clock() >= 0.1  # (the first two take their whole 50 ms)
    for r in reqs:
        r.output_ids.append(7)
        c.check_finished(r)  # a first cut each: the machine's, not yet the request's
    assert all(r.finished_reason is None for r in reqs) and c.alone == 0


def test_init_parallel_gives_the_finisher_and_the_grammar_queue_the_tp_group():
    from sglang.srt.managers.scheduler_components.scheduler_io import SchedulerIOMixin

    group = object()
    tp = SimpleNamespace(group=group, is_first=True, agree=lambda *a: None, gather=lambda memory: [memory])
    sched = SimpleNamespace(
        model_runner=SimpleNamespace(),
        pool_sizes=(1, 1),
        finisher=_checker(),
        grammar_queue=SimpleNamespace(group=None),
        request_deadlines=SimpleNamespace(),
        _record_deadline_abort=lambda *a: None,
    )
    SchedulerIOMixin.init_parallel(sched, tp, None)
    assert sched.finisher.group is group and sched.grammar_queue.group is group


def test_a_decode_set_without_measured_checks_is_not_scanned():
    """A decode batch whose requests have no grammar, stop_regex or custom logit processor skips the
    precheck's scan of its rows (`DecodeRows.measured_rows`, read once per decode set); such a request is
    the one row scanned."""
    from sglang.srt.managers.scheduler_components.batch_result_processor import BatchResultProcessor
    from sglang.srt.managers.scheduler_components.decode_rows import DecodeRows

    def req(rid: str, **params) -> Req:
        r = Req(rid, [5], SamplingParams(max_new_tokens=100, **params))
        r.req_pool_idx = r.mamba_pool_idx = 0
        return r

    plain = [req(f"p{i}") for i in range(3)]
    assert DecodeRows.of(plain).measured_rows == ()
    assert DecodeRows.of([*plain, req("r", stop_regex=["x"])]).measured_rows == (3,)
    g = _grammar_req("g")
    g.req_pool_idx = g.mamba_pool_idx = 0
    assert DecodeRows.of([g, *plain]).measured_rows == (0,)

    scanned = []
    c = _checker()
    c.precheck = lambda rows: scanned.append(list(rows))
    for measured in ((), (1,)):
        batch = SimpleNamespace(reqs=plain, measured_rows=measured, pending_tracks={}, any_stream=False)
        result = SimpleNamespace(next_token_ids=[7] * 3, next_token_logprobs=None, hidden_states=None)
        log = SimpleNamespace(log=lambda reqs, ids: False, take=lambda req=None: [])
        rp = SimpleNamespace(finisher=c, token_log=log, _commit_decode_tokens=lambda b, r: None)
        BatchResultProcessor.process_batch_result_decode(rp, batch, result)
    assert scanned == [[(plain[1], 7)]]  # (only the batch that has one, only its row)


def test_the_measured_output_reads_as_the_committed_list_without_changing_it():
    """`precheck` measures a row against its output with the token after it (`Appended`), without
    appending to `req.output_ids` (`BatchResultProcessor.commit` is the one place that does,
    test_commit_path): every length, index and slice the checks read equals the list's with the token
    appended, and the request's list is unchanged."""
    import random

    rng = random.Random(0)
    for n in (0, 1, 2, 5, 9):
        for tokens in ((7,), (7, 8), (7, 8, 9)):  # (a decode's token; a verify's accepted drafts and bonus)
            base = [rng.randrange(100) for _ in range(n)]
            view, full = Appended(base, tokens), [*base, *tokens]
            assert len(view) == len(full) and base == full[:n]
            for i in range(-len(full), len(full)):
                assert view[i] == full[i]
            for _ in range(200):
                a, b = rng.randint(-14, 14), rng.randint(-14, 14)
                a, b = rng.choice([a, None]), rng.choice([b, None])
                step = rng.choice([None, 1, 2, -1])
                assert view[a:b:step] == full[a:b:step], (n, tokens, a, b, step)
            with pytest.raises(IndexError):
                view[len(full)]
            with pytest.raises(IndexError):
                view[-len(full) - 1]


def test_which_requests_are_measured_is_one_rule_everywhere():
    """The rule (`finish_checker.is_measured`) as the check, the precheck's row filter and the decode rows
    read it, for each kind of request: a grammar, stop_regex, a custom logit processor and a charged stop
    list are measured; a plain request and a few short stop strings are not. (Three copies of the rule
    once lived in those three places.)"""
    from sglang.srt.constrained.stop_strings import CHARGED_STOPS
    from sglang.srt.managers.finish_checker import is_measured
    from sglang.srt.managers.scheduler_components.decode_rows import DecodeRows

    def req(rid: str, **params) -> Req:
        r = Req(rid, [5], SamplingParams(max_new_tokens=100, **params))
        r.req_pool_idx = r.mamba_pool_idx = 0
        return r

    processor = req("c")
    processor.custom_logit_processor = object()
    g = _grammar_req("g")
    g.req_pool_idx = g.mamba_pool_idx = 0
    kinds = {
        "grammar": (g, True),
        "stop_regex": (req("r", stop_regex=["x"]), True),
        "processor": (processor, True),
        "charged stops": (req("m", stop=[f"s{i}" for i in range(CHARGED_STOPS + 1)]), True),
        "few stops": (req("f", stop=["a", "b"]), False),
        "plain": (req("p"), False),
    }
    plain = req("p0")
    for kind, (r, expected) in kinds.items():
        c = _checker()
        c.precheck([(plain, 7), (r, 7)])
        prechecked = r in c._measured
        rows = DecodeRows.of([plain, r]).measured_rows
        assert is_measured(r) is FinishChecker.measured(r) is prechecked is expected, kind
        assert rows == ((1,) if expected else ()), kind
        assert plain not in c._measured


def _verify_step(monkeypatch, latest: float, search_s: float | None = None, width: int = 3):
    """16 stop_regex requests whose previous tokens cost `latest` each (the load), then a verify step that
    may commit `width` tokens each (accepted drafts and the bonus token; 1: a decode step), each search
    taking `search_s` seconds (None: 90% of the time it is given), cut where it is given less (a fake
    clock). Each request commits what `verify_tokens` allows. Returns the checker, the requests, the
    searches' limits in the order they ran, and the seconds the step's checks took."""
    searches = fake_stop_search(
        monkeypatch, lambda pattern, text, limit: 0.9 * limit if search_s is None else search_s
    )
    c = _checker()
    c.budget = OutputCheckBudget(per_request_s=0.05, per_step_s=0.1)
    reqs = [Req(f"r{i}", [5], SamplingParams(stop_regex=["x"], max_new_tokens=100)) for i in range(16)]
    for r in reqs:
        c.budget.charge(r, latest, "stop_regex")
    tokens = [7, 8, 9][:width]
    if width == 1:
        c.precheck([(r, 7) for r in reqs])
    else:
        c.precheck([(r, tokens) for r in reqs], several=True)
    assert c.agreements == 1
    for r in reqs:
        for token in tokens[: c.verify_tokens(r) or 1]:
            r.output_ids.append(token)
            c.check_finished(r)
    c.clear_prechecks()
    assert c.alone == 0 and all(r.finished_reason is None for r in reqs)
    return c, reqs, [limit for *_, limit in searches], stop_search.clock()


def test_a_verify_step_at_a_full_load_commits_as_a_decode_step(monkeypatch):
    """The load full (16 requests at a fair share, one step's budget in all): the step's budget has no
    room for a verify's tokens after each request's first at their requests' latest costs, so they are
    neither measured nor committed (`_precheck_tokens`, `verify_tokens`): the step commits and spends
    what a decode step would (one budget). Before, each later token was measured alone at its check with
    a request's whole share, and committed: 0.30 s of searches here, the width times the budget."""
    c, reqs, limits, spent = _verify_step(monkeypatch, 0.099 / 16)
    assert len(limits) == 16 and all(len(r.output_ids) == 1 for r in reqs)
    assert spent <= 0.1 and c.budget.load <= 0.1


def test_a_verify_steps_later_tokens_take_what_the_step_has_left(monkeypatch):
    """The load small (16 requests at 1 ms), each search 3 ms: every first token is given what a decode
    step gives it, then every second and every third token (by position) only what the step's budget has
    left beside all the step's costs: 16 second tokens and one third fit (0.052 s left after the first
    tokens), the next third token is given the 1 ms left (exactly its request's latest cost: it fits, float
    drift aside), cut there and committed as its row's last; the others are not measured (nothing left)
    nor committed. The step's checks take 0.1 s, its budget; before, each later token was measured
    alone at its check with a fair share at least (6.25 ms), and all 48 were committed: 0.144 s."""
    _, _, decode_limits, _ = _verify_step(monkeypatch, 0.001, 0.003, width=1)
    c, reqs, limits, spent = _verify_step(monkeypatch, 0.001, 0.003)
    # (the 14 third tokens left are not searched at all: nothing is left for them)
    assert len(limits) == 34 and limits[:16] == pytest.approx(decode_limits, rel=1e-9, abs=1e-12)
    assert limits[16] == pytest.approx(min(0.05, 0.1 - 16 * 0.003)) and limits[32] == pytest.approx(0.004)
    assert limits[33] == pytest.approx(0.001)  # (an exact fit: measured; 0.000999... < 0.001 skipped it)
    assert spent == pytest.approx(0.1) and spent <= 0.1 + 1e-9
    assert [len(r.output_ids) for r in reqs] == [3, 3] + [2] * 14
    assert not c.budget._over  # (a later token's overrun, the cut one, is no strike)


def test_a_verify_row_of_a_grammar_request_is_measured_at_its_first_token_only():
    """A request with a grammar has no drafts (its mask would have to follow them); should a verify row of
    one hold more tokens, only the first is measured with the batch (the matcher takes back no token it
    was fed), the others alone at their check: each token is fed once, in order."""
    c = _checker()
    req = _grammar_req("g")
    c.precheck([(req, [7, 8])], several=True)
    assert req.grammar.fed == 1 and c.agreements == 1
    for token in (7, 8):
        req.output_ids.append(token)
        c.check_finished(req)
    assert req.grammar.fed == 2 and c.alone == 1 and req.finished_reason is None


def test_a_verify_commits_no_token_after_its_first_that_went_over_its_share():
    """A verify row's token after its first whose search was cut (its share of the step was less than it
    took) is committed, but nothing after it (`verify_tokens`: its own cost decides only whether the tokens
    after it are, which the request samples again at the next step, as after a rejected draft); it is no
    strike and its cut search finds nothing (searched again at the next token). A row whose tokens all fit
    commits them all."""
    from sglang.srt.constrained import stop_search

    c = _checker()
    costly, cheap = (Req(r, [5], SamplingParams(stop_regex=[r], max_new_tokens=100)) for r in ("c", "d"))
    real = stop_search._first_match

    def search(patterns, text, limit):
        if patterns == ["c"] and text == "xxx":  # (the costly request's third token: cut)
            raise stop_search.StopRegexTimeout(patterns[0], limit, 0)
        return None

    stop_search._first_match = search
    try:
        c.precheck([(costly, [7, 7, 7, 7]), (cheap, [7, 7, 7, 7])], several=True)
    finally:
        stop_search._first_match = real
    assert c.verify_tokens(costly) == 3 and c.verify_tokens(cheap) == 4
    assert c.verify_tokens(_grammar_req("not prechecked")) is None
    for token in (7, 7, 7):
        costly.output_ids.append(token)
        c.check_finished(costly)
    assert costly.finished_reason is None and c.alone == 0
    assert costly not in c.budget._over  # (the cut one is a later token: no strike)




def _regex_reqs(*patterns: str) -> list[Req]:
    reqs = [Req(p, [5], SamplingParams(stop_regex=[p], max_new_tokens=100)) for p in patterns]
    for r in reqs:
        r.output_ids = [7]
    return reqs


def _commit_rows(c: FinishChecker, rows: list[tuple[Req, list[int]]]) -> None:
    """A verify's commit, as `NgramWorker.process_batch_result_verify`'s: row by row, each request's tokens
    in turn, as many as `verify_tokens` allows."""
    c.precheck(rows, several=True)
    for r, tokens in rows:
        for token in tokens[: c.verify_tokens(r)]:
            r.output_ids.append(token)
            c.check_finished(r)
            if r.finished_reason is not None:
                break
    c.clear_prechecks()


def test_a_verify_later_token_ends_no_request_for_another_rows_cost_drop(monkeypatch):
    """(review F1) A at 0.5 ms then 5 ms at its second token, B at 8 ms then 1 ms: the step's first
    tokens drop the load from 8.5 to 1.5 ms, but the commit charges A's second token before B's first, so
    room from B's drop is none for A's later token (the load would pass the step's 10 ms between the two
    charges and end B, the costliest, with a 400). A's later token is given the 1.5 ms the step has left
    beside the load (`PendingCharges.rise`): its search is cut there, it is committed and the row stops;
    nobody ends. Before, A's later token was given 8.5 ms and B ended ("among the costliest checks")."""
    cost = {("a", 1): 0.0005, ("a", 2): 0.0005, ("a", 3): 0.005, ("b", 1): 0.008, ("b", 2): 0.001}
    limits = fake_stop_search(monkeypatch, lambda p, text, limit: cost.get((p, len(text)), 0.001))
    c = _checker()
    c.budget = OutputCheckBudget(per_request_s=0.009, per_step_s=0.010)
    a, b = _regex_reqs("a", "b")
    c.budget.charge(a, 0.0005, "stop_regex")
    c.budget.charge(b, 0.008, "stop_regex")
    _commit_rows(c, [(a, [7, 7]), (b, [7])])
    assert a.finished_reason is None and b.finished_reason is None
    assert limits[-1] == ("a", 3, pytest.approx(0.0015)) and len(a.output_ids) == 3
    assert c.budget.load <= 0.010 + 1e-12


def test_whether_a_verify_commits_a_later_token_does_not_depend_on_its_own_cost(monkeypatch):
    """(review F2) The target samples 3 or 4 (p = 1/2 each) at the position after an accepted draft; the
    search of an output ending in 4 takes 4 ms, more than the 3 ms the step has left for that later token
    (cut), of one ending in 3 1 ms. Where the verify commits no token at that position the next step
    samples it again (always committed: a first token). The committed token must follow p: a verify
    commits the later token whatever its own cost (the row stops after it), so each of 2,000 fixed-seed
    draws is committed by the verify. Before, a cut 4 was dropped and drawn again: 4 came out 0.245 of
    the time. Bound: 0.5 +- 0.05 is 4.5 standard deviations of 2,000 fair draws (0.011); the seed is
    fixed, so the test is deterministic, and 0.245 is 23 standard deviations out."""
    import random

    _cost_by_last_char(monkeypatch)
    rng, counts, by_verify = random.Random(0), {3: 0, 4: 0}, 0
    for _ in range(2000):
        c = _checker()
        c.tokenizer = SimpleNamespace(decode=lambda ids, **kw: "".join(chr(97 + i) for i in ids))
        c.budget = OutputCheckBudget(per_request_s=0.01, per_step_s=0.004)
        (r,) = _regex_reqs("zz")
        c.budget.charge(r, 0.001, "stop_regex")
        t = rng.choice([3, 4])
        _commit_rows(c, [(r, [7, t])])
        assert r.finished_reason is None
        if len(r.output_ids) == 3:
            by_verify += 1
            counts[r.output_ids[-1]] += 1
        else:  # (the next step samples the position again, as its first token: always committed)
            counts[rng.choice([3, 4])] += 1
    assert by_verify == 2000
    assert abs(counts[4] / 2000 - 0.5) < 0.05, counts
    assert not c.budget._over  # (the cut later token is no strike)


def _cost_by_last_char(monkeypatch):
    """A search of an output ending in token 4 ("e") takes 4 ms, else 1 ms (a fake clock)."""
    fake_stop_search(monkeypatch, lambda pattern, text, limit: 0.004 if text.endswith("e") else 0.001)


def test_a_verify_later_token_uncut_but_over_its_allowance_is_committed_last(monkeypatch):
    """A later token whose search finished uncut but took more than its allowance (a search over what the
    agreed allowance left it, as under TP where a slower rank's time is agreed: here the fake clock's
    search ignores its limit: 4 ms for 3 ms, the request's allowance) is committed, the row stops after it
    though the step had room for the next (5 ms given it), and it is no strike: the request stays, and its
    next token over its allowance would be its first strike only."""
    now = [0.0]

    def search(patterns, text, limit):
        now[0] += 0.004 if len(text) == 3 else 0.001  # (the third token: 4 ms, uncut)
        return None

    monkeypatch.setattr(stop_search, "clock", lambda: now[0])
    monkeypatch.setattr(stop_search, "_first_match", search)
    c = _checker()
    c.budget = OutputCheckBudget(per_request_s=0.003, per_step_s=0.01)
    (r,) = _regex_reqs("q")
    c.budget.charge(r, 0.001, "stop_regex")
    c.precheck([(r, [7, 7, 7, 7])], several=True)
    assert c.verify_tokens(r) == 2  # (its second token, 4 ms over its 3 ms, is its last)
    for token in (7, 7):
        r.output_ids.append(token)
        c.check_finished(r)
    assert r.finished_reason is None and r not in c.budget._over and c.alone == 0


def test_a_verify_later_token_the_step_has_no_room_for_is_not_measured(monkeypatch):
    """The room gate alone: A and B at 3 ms (load 6 ms of 10), their first tokens 0.5 ms each (drops: no
    room for later tokens, `PendingCharges.rise`). A's second token fits the 4 ms of room at A's latest
    cost (3 ms) and takes 0.5 ms; B's would need 3 ms of the 1 ms of room left, so it is neither measured
    nor committed, though its allowance (10 - 6 - 0.5 = 3.5 ms) would have fit B's latest cost: what a
    verify spends measuring is bounded by its requests' latest costs."""
    limits = fake_stop_search(monkeypatch, lambda p, text, limit: 0.0005)
    c = _checker()
    c.budget = OutputCheckBudget(per_request_s=0.01, per_step_s=0.010)
    a, b = _regex_reqs("a", "b")
    for r in (a, b):
        c.budget.charge(r, 0.003, "stop_regex")
    c.precheck([(a, [7, 7]), (b, [7, 7])], several=True)
    assert [(p, n) for p, n, _ in limits] == [("a", 2), ("b", 2), ("a", 3)]
    assert c.verify_tokens(a) == 2 and c.verify_tokens(b) == 1


def test_a_verify_later_token_that_fits_exactly_is_measured(monkeypatch):
    """(review F5) A and B at 0.1 s each, a step of 0.3 s: the room and the allowance left for A's second
    token are 0.3 - 0.2, which is 0.09999999999999998 in floats, and A's latest cost 0.1 fits them exactly:
    it is measured and committed (before, the float drift left it out). B's then has no room."""
    limits = fake_stop_search(monkeypatch, lambda p, text, limit: 0.1 if len(text) == 2 else 0.05)
    c = _checker()
    c.budget = OutputCheckBudget(per_request_s=0.5, per_step_s=0.3)
    a, b = _regex_reqs("a", "b")
    for r in (a, b):
        c.budget.charge(r, 0.1, "stop_regex")
    assert 0.3 - c.budget.load < 0.1  # (the drift this test is about)
    c.precheck([(a, [7, 7]), (b, [7, 7])], several=True)
    assert [(p, n) for p, n, _ in limits] == [("a", 2), ("b", 2), ("a", 3)]
    assert c.verify_tokens(a) == 2 and c.verify_tokens(b) == 1


def test_the_rows_whose_later_tokens_are_measured_first_turn_with_each_verify(monkeypatch):
    """(review F4) Room for one later token a step (A and B at 3 ms, a step of 10 ms, each search 1 ms:
    4 ms of room, for one of them at its latest cost): the first row's later token takes it, and the next verify
    starts from the next row, so each request gets its extra token every other step (before: A always,
    B never). The turn is a count of verify steps, alike on every rank."""
    fake_stop_search(monkeypatch, lambda p, text, limit: 0.001)
    c = _checker()
    c.budget = OutputCheckBudget(per_request_s=0.01, per_step_s=0.010)
    a, b = _regex_reqs("a", "b")
    for r in (a, b):
        c.budget.charge(r, 0.003, "stop_regex")
    got = []
    for _ in range(4):
        c.precheck([(a, [7, 7]), (b, [7, 7])], several=True)
        got.append((c.verify_tokens(a), c.verify_tokens(b)))
        c.clear_prechecks()
    assert got == [(2, 1), (1, 2), (2, 1), (1, 2)] and c.verifies == 4


@pytest.mark.parametrize("verifies", [0, 1, 2])
def test_first_tokens_are_measured_in_the_commits_order_whatever_the_rotation(monkeypatch, verifies):
    """The later tokens' rows rotate from step to step (`verifies`), the first tokens' do not: a first
    token's allowance counts the rows measured before it as charged, cost drops included, and the commit
    charges in batch order. Rotated, A (first in the batch, measured after C and B) was given B's coming
    0.5 ms drop as room (9 ms), the load reached 12 ms of the step's 10 while A was charged, and B, the
    costliest, ended with a 400 (review R5 of 6445300); in batch order A's search is cut at 3.5 ms and
    nobody ends. Step 10 ms, request 9 ms."""
    cost = {("a", 2): 0.0055}
    fake_stop_search(monkeypatch, lambda p, text, limit: cost.get((p, len(text)), 0.0005))
    c = _checker()
    c.budget = OutputCheckBudget(per_request_s=0.009, per_step_s=0.010)
    a, cc, b = _regex_reqs("a", "c", "b")
    for r, spent in ((a, 0.0005), (cc, 0.0005), (b, 0.006)):
        c.budget.charge(r, spent, "stop_regex")
    c.verifies = verifies
    _commit_rows(c, [(a, [7]), (cc, [7]), (b, [7])])
    assert [r.finished_reason for r in (a, cc, b)] == [None, None, None]
