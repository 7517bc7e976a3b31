"""Held-back text while streaming: how much of a text's end may still become a marker (a stop string,
a reasoning or tool-call tag) once the next piece arrives."""

from __future__ import annotations

from collections.abc import Iterable


def partial_marker_len(text: str, markers: Iterable[str]) -> int:
    """The length of the longest end of `text` that begins one of `markers` (and is not all of it)."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best
