"""The scheduler's stop-string scan and the output checks' budget (managers/finish_checker.py): a request
whose stop list is larger than most clients' (`stops_charged`: more than 16 strings or one over 64
characters) has its tail's decode and scan timed into its check's cost, agreed under TP with the other
measured costs (one column of the batch's all-reduce), charged, and ended for the step's load with a
400 naming `stop`; a small list is not measured (no agreement, no budget entry). Time is a fake clock
that the stand-in tokenizer's decode advances: the decode is what such a scan costs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.constrained import stop_search
from sglang.srt.constrained.output_check_budget import OutputCheckBudget
from sglang.srt.constrained.stop_strings import CHARGED_STOP_CHARS, CHARGED_STOPS, stops_charged
from sglang.srt.managers import finish_checker as fc
from sglang.srt.managers.finish_checker import FinishChecker
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.scheduler_components.decode_rows import DecodeRows
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")

MANY = [f"zz{i}" for i in range(CHARGED_STOPS + 1)]  # charged by count
LONG = ["q" * (CHARGED_STOP_CHARS + 1)]  # charged by length
FEW = [f"zz{i}" for i in range(CHARGED_STOPS - 1)] + ["q" * CHARGED_STOP_CHARS]  # at both thresholds


@pytest.fixture
def clock(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(stop_search, "clock", lambda: now[0])
    return now


def _checker(now: list[float], decode_s: float, per_step_s: float = 0.2) -> FinishChecker:
    def decode(ids, **kw):
        now[0] += decode_s
        return "x" * len(ids)

    c = FinishChecker(set(), 4096, tokenizer=SimpleNamespace(decode=decode))
    c.budget = OutputCheckBudget(per_request_s=0.05, per_step_s=per_step_s)
    return c


def _req(rid: str, stop: list[str]) -> Req:
    req = Req(rid, [5], SamplingParams(stop=stop, max_new_tokens=100))
    req.req_pool_idx = req.mamba_pool_idx = 0
    return req


def test_which_lists_are_charged():
    assert stops_charged(MANY) and stops_charged(LONG)
    assert not stops_charged(FEW) and not stops_charged([])


@pytest.mark.parametrize("stop", [MANY, LONG], ids=["many", "long"])
def test_a_charged_stop_lists_scan_is_charged_to_the_budget(clock, stop):
    c = _checker(clock, decode_s=0.004)
    req = _req("r", stop)
    c.precheck([(req, 7)])
    assert c.agreements == 1  # (measured with the batch)
    req.output_ids.append(7)
    c.check_finished(req)
    assert req.finished_reason is None and c.alone == 0
    assert c.budget._cost[req] == (pytest.approx(0.004), "stop")
    assert c.budget.load == pytest.approx(0.004)


def test_a_small_stop_list_is_not_measured(clock):
    c = _checker(clock, decode_s=0.004)
    req = _req("r", FEW)
    c.precheck([(req, 7)])
    req.output_ids.append(7)
    c.check_finished(req)
    assert c.agreements == 0 and c.budget.load == 0 and req not in c.budget._cost
    req.output_ids.append(8)
    req.sampling_params.stop = [*FEW, "zz"]  # (a match is still found)
    c.tokenizer = SimpleNamespace(decode=lambda ids, **kw: "..zz..")
    c.check_finished(req)
    assert req.finished_reason == {"type": "stop", "matched": "zz"}


def test_charged_stop_scans_over_the_steps_budget_end_the_costliest_with_a_400_naming_stop(clock):
    """20 requests whose scan takes 10 ms a token against a 100 ms step: the load is kept under it by
    ending the latest-charged costliest, each with a 400 naming `stop` at its next check."""
    c = _checker(clock, decode_s=0.01, per_step_s=0.1)
    reqs = [_req(f"r{i}", MANY) for i in range(20)]
    for _ in range(2):
        c.precheck([(r, 7) for r in reqs if r.finished_reason is None])
        for r in reqs:
            if r.finished_reason is None:
                r.output_ids.append(7)
                c.check_finished(r)
        c.clear_prechecks()
    ended = [r for r in reqs if r.finished_reason is not None]
    assert 0 < len(ended) <= 11 and c.budget.load <= 0.1 + 1e-9
    for r in ended:
        assert r.finished_reason["status_code"] == 400 and r.finished_reason["param"] == "stop"
        assert "stop strings" in r.finished_reason["message"], r.finished_reason["message"]


def test_the_scans_time_is_agreed_with_the_ranks(clock, monkeypatch):
    """Under TP the scan's seconds are a column of the batch's all-reduce (MAX): another rank's longer
    scan is what every rank charges."""
    c = _checker(clock, decode_s=0.002)
    c.group = object()
    seen = []

    def all_reduce(values, op, group):
        seen.append(values.clone())
        values[:, 3] = torch.maximum(values[:, 3], torch.tensor(0.03, dtype=values.dtype))

    monkeypatch.setattr(fc.dist, "all_reduce", all_reduce)
    req = _req("r", LONG)
    c.precheck([(req, 7)])
    req.output_ids.append(7)
    c.check_finished(req)
    assert len(seen) == 1 and seen[0][0, 3].item() == pytest.approx(0.002)
    assert c.budget._cost[req] == (pytest.approx(0.03), "stop")


def test_a_decode_set_with_a_charged_stop_list_is_prechecked():
    plain = [_req(f"p{i}", []) for i in range(2)]
    assert DecodeRows.of([*plain, _req("f", FEW)]).measured_rows == ()
    assert DecodeRows.of([*plain, _req("m", MANY)]).measured_rows == (2,)
    assert FinishChecker.measured(_req("m", MANY)) and not FinishChecker.measured(_req("f", FEW))


def test_a_charged_stop_list_still_stops_where_its_string_appears(clock):
    c = _checker(clock, decode_s=0.001)
    req = _req("r", [*MANY, "xxx"])  # (the stand-in decode gives one "x" per token)
    for token in (7, 7):
        c.precheck([(req, token)])
        req.output_ids.append(token)
        c.check_finished(req)
        c.clear_prechecks()
        assert req.finished_reason is None
    c.precheck([(req, 7)])
    req.output_ids.append(7)
    c.check_finished(req)
    assert req.finished_reason == {"type": "stop", "matched": "xxx"} and c.alone == 0


def test_a_stop_of_multi_token_characters_ends_its_request():
    """The scheduler decodes enough of the output's tail to hold a stop whose characters are several
    byte-level tokens each (`stop_window_tokens`: its UTF-8 bytes + 8). With the window counted in
    characters (+ 8) four emoji (16 tokens in the tiny tokenizer) or five rare CJK characters (15) never
    fit, and the request ran to max_new_tokens with no matched stop while the HTTP side cut its text."""
    from sglang.srt.utils.hf_transformers_utils import get_tokenizer

    tok = get_tokenizer("tiny-qwen3-next")
    c = FinishChecker(set(), 4096, tok)
    for stop in ("STOP", "😀😀😀😀", "龘龘龘龘龘"):
        out = tok.encode("hello world " + stop, add_special_tokens=False)
        assert len(tok.encode(stop, add_special_tokens=False)) > len(stop) or stop == "STOP"
        req = Req("r", [5], SamplingParams(max_new_tokens=1000, stop=[stop]))
        req.output_ids = out
        c.check_finished(req)
        assert req.finished_reason == {"type": "stop", "matched": stop}, (stop, req.finished_reason)
