"""The finish check's search of a request's output tail for its stop strings and stop regexes
(`managers/finish_checker.py` calls `match_stop_string` after each token): the tail's decode, the stop
strings' scan, and the regexes' search within what is left of the request's allowance for the token
(`output_check_budget.py`), cut for time with the `regex` module's timeout (`StopRegexTimeout`).

What the search took goes to the check's measure (`work`: `stop_s` for the decode and the strings' scan,
`regex_s` for the search), which the TP ranks agree on before the budget reads it."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from sglang.srt.constrained.output_check_budget import clock
from sglang.srt.constrained.stop_regex import compiled
from sglang.srt.constrained.stop_strings import stop_window_tokens

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

# Output tokens decoded to look for a stop regex: a regex has no length to size the window by.
STOP_REGEX_TAIL_TOKENS = 64


class StopRegexTimeout(Exception):
    """A stop regex ran out of its time on the output's tail."""

    def __init__(self, pattern: str, limit: float, index: int = 0):
        super().__init__(pattern)
        self.pattern = pattern
        self.limit = limit
        self.index = index  # (in the request's stop_regex list)


def match_stop_string(tokenizer: Any, req: Req, work: Any = None, out: Any = None) -> str | None:
    """The stop string in the output's tail, else the stop regex (its pattern, as upstream reports it)
    that matches there, else None (None too without a tokenizer). `out`: the output, by default
    `req.output_ids`. With `work` (a budgeted request's check, `finish_checker._Work`), the tail's decode
    and the stop strings' scan add their time to `work.stop_s`, and the regexes' search takes what is left
    of `work.allowance` (raises StopRegexTimeout beyond it) and adds its time to `work.regex_s` (a request
    with stop regexes is always checked with one: `FinishChecker.check_finished`)."""
    if tokenizer is None:
        return None
    sp = req.sampling_params
    start = clock()
    window = stop_window_tokens(sp.stop)
    if sp.stop_regex:
        window = max(window, STOP_REGEX_TAIL_TOKENS)
    out = req.output_ids if out is None else out
    tail = tokenizer.decode(out[-window:], skip_special_tokens=False)
    matched = next((s for s in sp.stop if s in tail), None)
    if work is not None:
        work.stop_s = clock() - start
    if matched is None and sp.stop_regex:
        for pattern in sp.stop_regex:
            compiled(pattern)  # (once per process, bounded by stop_regex.MAX_CHARS: not the search's)
        start = clock()
        try:
            matched = _first_match(sp.stop_regex, tail, work.allowance - work.grammar_s - work.stop_s)
        finally:
            work.regex_s = clock() - start
    return matched


def _first_match(patterns: list[str], text: str, limit: float) -> str | None:
    """The first pattern found in `text`, within `limit` seconds for them all (the `regex` module's
    timeout counts the process's CPU time, every thread's: with other threads busy it cuts a search
    sooner)."""
    deadline = clock() + limit
    for index, pattern in enumerate(patterns):
        left = deadline - clock()
        try:
            if left <= 0:
                raise TimeoutError
            if compiled(pattern).search(text, timeout=None if left == math.inf else left) is not None:
                return pattern
        except TimeoutError:
            raise StopRegexTimeout(pattern, limit, index) from None
    return None


def search_message(req: Req, index: int | None, limit: float) -> str:
    """Why a request's stop_regex search ends it: its pattern `index` (None: the search of them all) took
    more than `limit`."""
    patterns = req.sampling_params.stop_regex
    if index is None and len(patterns) > 1:
        what = f"stop_regex (its {len(patterns)} patterns)"
    else:
        what = f"stop_regex {patterns[index or 0]!r}"
    return (
        f"{what} took more than the {limit * 1e3:.0f} ms a "
        "request's checks may take for one token (SGLANG_OUTPUT_CHECK_BUDGET_PER_REQ, within "
        "SGLANG_OUTPUT_CHECK_BUDGET_PER_STEP for all requests) to search the output; use a pattern that "
        "does not backtrack without bound."
    )
