"""Custom logit processors (upstream's `custom_logit_processor` + `sampling_params.custom_params`) in the
scheduler: a processor's rows sample what it leaves them, after it saw its request's outputs so far
("__req__", with the overlap schedule too); the other requests of the batch are untouched (the
oracle's outputs); NGRAM gives such a request no drafts; a processor that raises ends its requests with
a 400 and nothing leaks; a payload that does not load is a 400 naming the field."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.sampling.custom_logit_processor import (
    CustomLogitProcessor,
    DisallowedTokensLogitsProcessor,
    ThinkingBudgetLogitProcessor,
    load_processor,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=20, suite="per-commit-cpu")

QWEN = "tiny-qwen3-next"


def force(logits: torch.Tensor, row: int, token: int) -> None:
    logits[row] = float("-inf")
    logits[row, token] = 0.0


class SwitchAfter(CustomLogitProcessor):
    """Token `a` while the request has fewer than `k` outputs, then `b`: what a thinking budget does,
    counting the request's own outputs."""

    def __call__(self, logits, custom_param_list=None):
        for row, p in enumerate(custom_param_list):
            force(logits, row, p["a"] if len(p["__req__"].output_ids) < p["k"] else p["b"])
        return logits


class Fails(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        if any(len(p["__req__"].output_ids) >= 3 for p in custom_param_list):
            raise RuntimeError("budget table missing")
        return logits


class NeedsArgs(CustomLogitProcessor):
    def __init__(self, table):
        self.table = table

    def __call__(self, logits, custom_param_list=None):
        return logits


class WrongShape(CustomLogitProcessor):
    def __call__(self, logits, custom_param_list=None):
        return logits[:, :5]


@pytest.mark.parametrize("overlap", [True, False])
def test_processors_see_their_outputs_and_leave_the_others_alone(oracles, overlap):
    h = SchedulerHarness(QWEN, disable_overlap_schedule=not overlap, enable_custom_logit_processor=True)
    switch = SwitchAfter.to_str()
    plain_prompts = [token_ids(30 + 7 * k, seed=k) for k in range(3)]
    plain = [h.submit(p, max_new_tokens=12) for p in plain_prompts]
    forced = [
        h.submit(token_ids(25, seed=10 + k), max_new_tokens=12, custom_logit_processor=switch,
                 custom_params={"a": 7 + k, "b": 100 + k, "k": 4 + k})
        for k in range(2)
    ]  # fmt: skip
    banned = h.generate(  # upstream's built-in, by its name: the oracle's greedy tokens are banned
        plain_prompts[0], max_new_tokens=12, custom_logit_processor=DisallowedTokensLogitsProcessor.to_str(),
        custom_params={"token_ids": sorted(set(oracles[QWEN].greedy(plain_prompts[0], 12)))},
    )  # fmt: skip
    for k, rid in enumerate(forced):
        out = h.outputs[rid]
        assert out.output_ids == [7 + k] * (4 + k) + [100 + k] * (8 - k)
        assert out.logprobs == [0.0] * 12  # (the sampled token holds all the mass it left)
    for p, rid in zip(plain_prompts, plain, strict=True):
        h.check_oracle(oracles[QWEN], p, h.outputs[rid])
    assert not set(banned.output_ids) & set(oracles[QWEN].greedy(plain_prompts[0], 12))
    assert h.sched.custom_logit_reqs == 0
    h.sched.check_integrity()
    h.shutdown()


def test_a_failing_processor_ends_its_requests_with_a_400_only(oracles):
    h = SchedulerHarness(QWEN, enable_custom_logit_processor=True)
    other = token_ids(40, seed=2)
    fails = Fails.to_str()
    rids = [h.submit(token_ids(20, seed=1), max_new_tokens=10, custom_logit_processor=fails)]
    # Penalized (its finish check would otherwise wait for max_new_tokens): it fails at the same token.
    rids.append(h.submit(token_ids(20, seed=1), max_new_tokens=10, custom_logit_processor=fails,
                         frequency_penalty=0.5))  # fmt: skip
    rids.append(h.submit(other, max_new_tokens=10))
    rids.append(h.submit(other, max_new_tokens=10, custom_logit_processor=WrongShape.to_str()))
    bad = ['{"callable": "00ff"}', "not json", CustomLogitProcessor.to_str(), NeedsArgs.to_str()]
    rids += [h.submit(other, max_new_tokens=10, custom_logit_processor=text) for text in bad]
    h.run()
    failed, penalized, ok, wrong, bad_pickle, bad_json, abstract, needs_args = (h.outputs[r] for r in rids)
    for out in (failed, penalized):
        assert out.finished_reason["status_code"] == 400
        assert out.finished_reason["param"] == "custom_logit_processor"
        assert "RuntimeError: budget table missing" in out.finished_reason["message"]
        assert len(out.output_ids) == 4  # three by the processor, the fourth sampled as it raised
    h.check_oracle(oracles[QWEN], other, ok)
    assert "returned (1, 5) for logits of shape (1, " in wrong.finished_reason["message"]
    assert len(wrong.output_ids) == 1
    for out in (bad_pickle, abstract, needs_args):
        assert "cannot be loaded" in out.finished_reason["message"]
    assert "abstract" in abstract.finished_reason["message"]
    assert "CustomLogitProcessor.to_str()" in bad_json.finished_reason["message"]
    for out in (bad_pickle, bad_json, abstract, needs_args):
        reason = out.finished_reason
        assert (reason["param"], reason["status_code"]) == ("custom_logit_processor", 400)
    # Every check of a request with a processor was measured with its batch's (under TP: the batch's one
    # agreement on which processors failed, on any rank), none alone.
    assert h.sched.finisher.alone == 0 and h.sched.finisher.agreements > 0
    h.sched.check_integrity()
    h.flush_and_check_empty()
    h.shutdown()


def test_ngram_gives_a_request_with_a_processor_no_drafts(oracles):
    prompt = token_ids(40, seed=3)
    spec = dict(speculative_algorithm="NGRAM", speculative_num_draft_tokens=6)
    h = SchedulerHarness(QWEN, enable_custom_logit_processor=True, **spec)
    h.generate(prompt, max_new_tokens=40)  # its text is what the next requests draft from
    before = h.sched.spec.stats["verify_steps"]
    drafting = h.submit(prompt, max_new_tokens=40)
    params = {"a": 11, "b": 12, "k": 5}
    switch = SwitchAfter.to_str()
    forced = h.submit(prompt, max_new_tokens=30, custom_logit_processor=switch, custom_params=params)
    h.run()
    assert h.sched.spec.stats["verify_steps"] - before >= 3, "the pair verified together"
    assert h.outputs[forced].output_ids == [11] * 5 + [12] * 25
    h.check_oracle(oracles[QWEN], prompt, h.outputs[drafting])
    req = h.sched.spec  # the rule itself
    h.submit(prompt, max_new_tokens=40, custom_logit_processor=switch, custom_params=params)
    h.sched.step()
    queued = h.sched.running[0] if h.sched.running else h.sched.waiting_queue[0]
    assert req._draft(queued) == []
    queued.custom_logit_processor, saved = None, queued.custom_logit_processor
    assert req._draft(queued), "its text is in the cache"
    queued.custom_logit_processor = saved
    h.run()
    h.sched.check_integrity()
    h.shutdown()


class TinyThinkingBudget(ThinkingBudgetLogitProcessor):
    """Upstream's thinking budget with ids the tiny vocabulary has."""

    THINKING_START_TOKEN_ID, THINKING_END_TOKEN_ID, NEW_LINE_TOKEN_ID = 7, 8, 9


def budgeted_greedy(oracle, prompt: list[int], budget: int, n: int) -> list[int]:
    """The oracle's greedy tokens with the budget's rule applied token by token (written out here from
    the rule: past `budget` tokens of an open section, a newline unless the last token is one, then the
    end token)."""
    ids: list[int] = list(prompt)
    for _ in range(n):
        starts = [i for i, t in enumerate(ids) if t == 7]
        start = starts[-1] if starts and 8 not in ids[starts[-1] :] else -1
        if start >= 0 and len(ids) - start - 1 >= budget:
            ids.append(8 if ids[-1] == 9 else 9)
        else:
            ids += oracle.greedy(ids, 1)
    return ids[len(prompt) :]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_thinking_budget_closes_the_section_then_lets_the_model_answer(oracles, overlap):
    h = SchedulerHarness(QWEN, disable_overlap_schedule=not overlap, enable_custom_logit_processor=True)
    payload = TinyThinkingBudget.to_str()
    prompts = [[t for t in token_ids(24, seed=20 + k) if t not in (7, 8, 9)] + [7] for k in range(3)]
    budgets = [0, 5, None]  # None: no budget, the processor leaves the request alone
    rids = [
        h.submit(p, max_new_tokens=14, custom_logit_processor=payload,
                 custom_params={} if b is None else {"thinking_budget": b})
        for p, b in zip(prompts, budgets, strict=True)
    ]  # fmt: skip
    h.run()
    for p, b, rid in zip(prompts, budgets, rids, strict=True):
        want = oracles[QWEN].greedy(p, 14) if b is None else budgeted_greedy(oracles[QWEN], p, b, 14)
        assert h.outputs[rid].output_ids == want
    assert h.outputs[rids[0]].output_ids[:2] == [9, 8]  # budget 0: the section closes at once
    assert h.outputs[rids[1]].output_ids[5:7] == [9, 8]  # (the model had not closed it by itself)
    h.sched.check_integrity()
    h.shutdown()


def test_the_budget_scan_follows_each_request_as_it_grows():
    """Step by step against the rule on the whole sequence: sections closed earlier in the prompt (a
    previous turn), sections opened and closed in the output, a scan kept per request object."""
    proc, gen = TinyThinkingBudget(), torch.Generator().manual_seed(0)
    for trial in range(30):
        size = int(torch.randint(1, 12, (1,), generator=gen))
        prompt = torch.randint(5, 12, (size,), generator=gen).tolist()
        req = SimpleNamespace(rid="same-rid", origin_input_ids=prompt, output_ids=[], custom_logit_state=None)
        budget = trial % 4
        for _ in range(25):
            logits = torch.zeros(1, 16)
            proc(logits, [{"thinking_budget": budget, "__req__": req}])
            ids = prompt + req.output_ids
            starts = [i for i, t in enumerate(ids) if t == 7]
            open_at = starts[-1] if starts and 8 not in ids[starts[-1] :] else -1
            forced = open_at >= 0 and len(ids) - open_at - 1 >= budget
            assert bool((logits == float("-inf")).any()) == forced, (prompt, req.output_ids, budget)
            token = int(logits.argmax()) if forced else int(torch.randint(5, 12, (1,), generator=gen))
            req.output_ids.append(token)


def test_a_payload_loads_once_per_text():
    text = SwitchAfter.to_str()
    assert load_processor(text) is load_processor(text)
    assert isinstance(CustomLogitProcessor.from_str(text), SwitchAfter)


def test_with_a_secret_only_payloads_signed_with_it_load():
    unsigned = SwitchAfter.to_str()
    assert isinstance(load_processor(unsigned), SwitchAfter)  # (loaded without a secret: cached so)
    with envs.SGLANG_LOGIT_PROCESSOR_SECRET.override("s3cret"):
        signed = SwitchAfter.to_str()
        assert isinstance(load_processor(signed), SwitchAfter)
        forged = json.loads(signed)
        # Another class under the old signature:
        forged["callable"] = json.loads(NeedsArgs.to_str())["callable"]
        odd = json.loads(signed) | {"signature": "\u00e9"}  # (str comparison raises TypeError on these)
        # A payload that would fail to unpickle says "not signed": it is checked before dill runs.
        for payload in (unsigned, json.dumps(forged), json.dumps(odd), '{"callable": "00ff"}'):
            with pytest.raises(ValueError, match="not signed with this server's SGLANG_LOGIT_PROCESSOR"):
                load_processor(payload)
    with envs.SGLANG_LOGIT_PROCESSOR_SECRET.override("another"):
        with pytest.raises(ValueError, match="not signed"):
            load_processor(signed)


@pytest.mark.parametrize("payload", ["[" * 200_000, "[1, 2]", '{"callable": 5}', "null"])
def test_any_payload_is_a_value_error(payload):
    with pytest.raises(ValueError, match="must be the JSON that CustomLogitProcessor.to_str"):
        load_processor(payload)
