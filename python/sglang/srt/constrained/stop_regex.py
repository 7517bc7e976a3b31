"""`stop_regex` (upstream's sampling field): its bounds, checked where the request comes in, and its
patterns compiled once per process for the finish check's search (`stop_search.py`, within
the output checks' budget, `output_check_budget.py`).

Upstream searches with Python's `re`, lookarounds and backreferences included; the `regex` module keeps
those semantics (RE2, linear-time, has neither). What `regex` costs is bounded here instead:

- at most MAX_PATTERNS patterns of MAX_CHARS characters together: compiling takes time in proportion
  to the characters (its parser is Python), so the worst pattern under the cap stalls the HTTP event
  loop that checks it for milliseconds (test/unit/scheduler/test_output_check_budget.py bounds it;
  timings: benchmark/README.md);
- `regex` unrolls a counted repeat (`a{1000000}` is a million-character literal, slow to compile and
  large; `a{4294967294}` exhausts memory): the characters a pattern would unroll to, repeat counts
  multiplied through nested groups, are at most MAX_UNROLLED;
- groups nest at most MAX_NESTING deep (its parser recurses on them: 5,000 raised RecursionError).

Each bound and every pattern `regex` refuses is a 400 naming stop_regex.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import regex

MAX_PATTERNS = 16
MAX_CHARS = 4096
MAX_UNROLLED = 10_000
MAX_NESTING = 100

_REPEAT = re.compile(r"\{(\d*)(?:,(\d*))?\}")


def check_stop_regex(patterns: Any, error: type[Exception]) -> None:
    """Raise `error` naming stop_regex when `patterns` is not a list of patterns within the bounds that
    `regex` compiles."""
    if not isinstance(patterns, list) or not all(isinstance(s, str) and s for s in patterns):
        raise error("stop_regex must be a non-empty string or a list of non-empty strings.")
    if len(patterns) > MAX_PATTERNS:
        raise error(f"stop_regex has {len(patterns)} patterns; at most {MAX_PATTERNS} are allowed.")
    chars = sum(len(p) for p in patterns)
    if chars > MAX_CHARS:
        raise error(f"stop_regex has {chars} characters; at most {MAX_CHARS} are allowed in all.")
    for pattern in patterns:
        why = pattern_bound_error(pattern, MAX_UNROLLED)
        if why is None:
            try:
                compiled(pattern)
            except (regex.error, RecursionError, OverflowError, ValueError, MemoryError) as e:
                why = f"is not a valid regular expression: {e}"
        if why is not None:
            raise error(f"stop_regex {_short(pattern)} {why}.")


@functools.lru_cache(maxsize=256)
def compiled(pattern: str) -> regex.Pattern:
    """`pattern` compiled (patterns within the bounds: each is at most MAX_CHARS characters)."""
    return regex.compile(pattern)


def pattern_bound_error(pattern: str, max_unrolled: int) -> str | None:
    """Why `pattern` nests groups too deep or unrolls to more than `max_unrolled` characters, or None. A
    scan, not a parse: it may count a brace in a character class as a repeat, which only overestimates."""
    totals = [0]  # characters of each open group so far
    last = 0  # characters of the atom a repeat would apply to
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 2
            last = 1
        elif c == "(":
            totals.append(0)
            if len(totals) > MAX_NESTING + 1:
                return f"nests groups more than {MAX_NESTING} deep"
            i += 1
            continue
        elif c == ")" and len(totals) > 1:
            last = totals.pop()
            i += 1
        elif c == "{" and (m := _REPEAT.match(pattern, i)) and (m.group(1) or m.group(2)):
            count = max(int(m.group(1) or 0), int(m.group(2) or 0))
            totals[-1] += last * (count - 1) if count else 0
            last *= count
            i = m.end()
            if totals[-1] > max_unrolled:
                break
            continue
        else:
            last = 1
            i += 1
        totals[-1] += last
        if totals[-1] > max_unrolled:
            break
    if sum(totals) > max_unrolled:
        return f"repeats to more than {max_unrolled:,} characters (counted repeats multiply)"
    return None


def _short(pattern: str) -> str:
    return repr(pattern) if len(pattern) <= 80 else repr(pattern[:60]) + f"... ({len(pattern)} characters)"
