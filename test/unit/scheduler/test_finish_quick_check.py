"""The decode result loop's quick finish check (`FinishChecker.set_quick_check`) never skips a finish:
for any sampling parameters, prompt length and output, whenever `check_finished` ends a request at an
output token, the quick check asked for that check. And it does skip: a plain request's ordinary tokens
below its limits are not checked."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.managers.finish_checker import FinishChecker
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")

CONTEXT_LEN = 64
EOS = {2, 3}


class _Tail:
    """A tokenizer stand-in for stop strings: token t decodes to chr(97 + t)."""

    @staticmethod
    def decode(ids, skip_special_tokens=False):
        return "".join(chr(97 + t) for t in ids)


@settings(max_examples=300, deadline=None)
@given(
    prompt_len=st.integers(1, CONTEXT_LEN - 1),
    max_new=st.integers(1, 40),
    min_new=st.integers(0, 40),
    stop_ids=st.lists(st.integers(0, 9), max_size=3),
    ignore_eos=st.booleans(),
    stop=st.sampled_from([[], ["cd"], ["j"]]),
    outputs=st.lists(st.integers(0, 9), min_size=1, max_size=40),
)
def test_the_quick_check_asks_for_every_finish(
    prompt_len, max_new, min_new, stop_ids, ignore_eos, stop, outputs
):
    checker = FinishChecker(set(EOS), CONTEXT_LEN, tokenizer=_Tail())
    params = SamplingParams(
        max_new_tokens=max_new,
        min_new_tokens=min(min_new, max_new),
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        stop=stop,
    )
    req = Req("r", [5] * prompt_len, params)
    for step, token in enumerate(outputs):
        req.output_ids.append(token)
        if step:  # the first check sets the quick check up
            quick = len(req.output_ids) >= req.finish_check_len or token in req.finish_token_ids
        checker.check_finished(req)
        if req.finished_reason is not None:
            assert step == 0 or quick, (req.finished_reason, step)
            return


def test_ordinary_tokens_of_a_plain_request_are_not_checked():
    checker = FinishChecker(set(EOS), CONTEXT_LEN)
    req = Req("r", [5] * 10, SamplingParams(max_new_tokens=20, stop_token_ids=[7]))
    req.output_ids.append(4)
    checker.check_finished(req)
    assert req.finish_token_ids == {2, 3, 7} and req.finish_check_len == 20
    # Context length binds before max_new_tokens: 64 - 60 = 4 outputs.
    long = Req("l", [5] * 60, SamplingParams(max_new_tokens=20, ignore_eos=True))
    long.output_ids.append(4)
    checker.check_finished(long)
    assert long.finish_token_ids == frozenset() and long.finish_check_len == 4


def test_a_stop_regex_that_backtracks_without_bound_ends_its_request_in_time():
    """`(a|aa)+$` on "aaa...ab" backtracks exponentially (hours with `re`): the search is cut at its time
    budget and the request ends with a 400 naming stop_regex at its second such token (one token over
    its allowance may be the machine's hiccup), instead of the scheduler hanging. The budget is shared:
    many such patterns take it once. A sane pattern still stops the request."""
    import time

    from sglang.srt.environ import envs

    checker = FinishChecker(set(EOS), 1000, tokenizer=_Tail())
    reasons = {}
    for patterns in (["(a|aa)+$"], ["a{3}b$"], ["(a|aa)+$"] * 20):
        req = Req("r", [5], SamplingParams(max_new_tokens=100, stop_regex=patterns))
        req.output_ids = [0] * 40 + [1]  # "aaa...ab"
        for token in range(2):
            start = time.process_time()
            checker.check_finished(req)
            # The search's timeout counts this process's CPU time (the regex module's clock), which
            # is what the check costs the scheduler; wall time also counts other processes on a
            # loaded machine (it failed once at load 7), which the check cannot bound.
            assert time.process_time() - start < 3 * envs.SGLANG_OUTPUT_CHECK_BUDGET_PER_REQ.get() + 0.5
            if token == 0 and patterns[0] != "a{3}b$":
                assert req.finished_reason is None, "one token over the allowance ended the request"
        reasons[patterns[0]] = req.finished_reason
    assert reasons["a{3}b$"] == {"type": "stop", "matched": "a{3}b$"}
    cut = reasons["(a|aa)+$"]
    assert cut["type"] == "abort" and cut["status_code"] == 400 and "stop_regex '(a|aa)+$'" in cut["message"]
    assert cut["param"] == "stop_regex"
