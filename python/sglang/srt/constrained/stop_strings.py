"""`stop` (upstream's sampling field, a string or a list): its bounds, checked where the request comes in,
and which lists the scheduler's finish check charges to the output checks' budget. The one owner of
both: the HTTP process (`sampling_params.verify`) and the scheduler (`managers/finish_checker.py`,
`scheduler_components/decode_rows.py`) read them from here.

Where stop strings cost:

- the HTTP process holds back, while a request streams, text that may begin a stop string, and cuts
  the text at one (`managers/tokenizer_output.py`, `utils/text_markers.py`): per chunk and sample a
  search of each string over the new text and the held-back tail (under a string's length);
- the scheduler decodes the output's last (longest string's UTF-8 bytes + 8) tokens after every token
  and looks for each string in them (`stop_search.match_stop_string`, `stop_window_tokens`).

Upstream takes any list; OpenAI allows 4; real clients send a handful to a few dozen (a chat template's
end markers, tool-call markers, a harness's few-shot separators), each under a hundred characters. The
bounds below are 5-10x that: at most MAX_STOPS strings of at most MAX_STOP_CHARS characters each and
MAX_STOP_TOTAL_CHARS in all. At them the scheduler's check takes ~0.35 ms a token on a loaded 2-core
host (a 1,032-token decode ~0.24 ms, 256 searches of its text ~0.1 ms), and a stream's chunk scans at
most (MAX_STOP_CHARS + new characters) x MAX_STOPS characters in C. Before them a 619 KB list of 30,000
strings held the HTTP event loop ~90 ms per chunk and one 200,000-character string made the scheduler
decode the whole output at every token (the review of 2026-11-29, failures 1 and 3).

A list over CHARGED_STOPS strings, or with a string over CHARGED_STOP_CHARS UTF-8 bytes, is charged to
the output checks' budget like a stop_regex (its scan timed, agreed under tensor parallelism, and the
request ended with a 400 naming `stop` where the load goes over the step's budget). A smaller list is
not: its check (a <= 72-token decode and <= 16 searches) takes ~30 us a token, a normal request's
order of cost, and charging it would make every step of the many requests that send a few stop strings
pay the ranks' agreement (one all-reduce per step under --tp-size > 1, ~1-2 ms;
benchmark/bench_output_check_agreement.py).
"""

from __future__ import annotations

from typing import Any

MAX_STOPS = 256
MAX_STOP_CHARS = 1024
MAX_STOP_TOTAL_CHARS = 16384
CHARGED_STOPS = 16
CHARGED_STOP_CHARS = 64


def check_stops(stops: Any, error: type[Exception]) -> None:
    """Raise `error` naming stop when `stops` is not a list of non-empty strings within the bounds."""
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise error("stop must be a non-empty string or a list of non-empty strings.")
    if len(stops) > MAX_STOPS:
        raise error(f"stop has {len(stops)} strings; at most {MAX_STOPS} are allowed.")
    longest = max(map(len, stops), default=0)
    if longest > MAX_STOP_CHARS:
        raise error(f"stop has a string of {longest} characters; at most {MAX_STOP_CHARS} are allowed.")
    total = sum(map(len, stops))
    if total > MAX_STOP_TOTAL_CHARS:
        raise error(f"stop has {total} characters; at most {MAX_STOP_TOTAL_CHARS} are allowed in all.")


def stops_charged(stops: list[str]) -> bool:
    """Whether the scheduler charges the scan for `stops` (a list within the bounds) to the output checks'
    budget (see the module's docstring): more than CHARGED_STOPS strings, or one longer than
    CHARGED_STOP_CHARS in UTF-8 bytes (what sizes the scheduler's decode, `stop_window_tokens`). At most
    CHARGED_STOPS strings are read."""
    return len(stops) > CHARGED_STOPS or any(len(s.encode()) > CHARGED_STOP_CHARS for s in stops)


def stop_window_tokens(stops: list[str]) -> int:
    """How many of the output's last tokens the scheduler decodes to find any of `stops` ending there: a
    token holds at least one byte of text (byte-level BPE, and SentencePiece's byte fallback), so a
    string of b UTF-8 bytes spans at most b tokens, and 8 more cover a token split at either end. (A
    character count fell short: an emoji is 4 bytes, and 4 byte-level tokens where the vocabulary has no
    merge for it, so four emoji are 16 tokens; upstream sizes its window by encoding each string.)"""
    return max((len(s.encode()) for s in stops), default=0) + 8
