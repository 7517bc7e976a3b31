"""stop_regex searches on a fake clock, for tests of the output checks' budget: each search of
`patterns` over a text costs `cost_of(pattern, text, limit)` seconds of `stop_search.clock`, and one that
costs more than its limit is cut there (StopRegexTimeout), as the real search is. `stop_search.clock()`
reads the fake clock (the seconds the searches took)."""

from __future__ import annotations

from collections.abc import Callable


def fake_stop_search(monkeypatch, cost_of: Callable[[str, str, float], float]) -> list[tuple[str, int, float]]:
    """Patch `stop_search`'s clock and search; returns the (pattern, text length, limit) of every search."""
    from sglang.srt.constrained import stop_search

    now = [0.0]
    limits: list[tuple[str, int, float]] = []

    def search(patterns, text, limit):
        limits.append((patterns[0], len(text), limit))
        cost = cost_of(patterns[0], text, limit)
        if cost > limit:
            now[0] += max(limit, 0.0)
            raise stop_search.StopRegexTimeout(patterns[0], limit, 0)
        now[0] += cost
        return None

    monkeypatch.setattr(stop_search, "clock", lambda: now[0])
    monkeypatch.setattr(stop_search, "_first_match", search)
    return limits
