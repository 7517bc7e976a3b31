"""`Keepalive`: what a streaming route sends where it has been silent for KEEPALIVE_SECONDS: an SSE comment
on the OpenAI routes (chat, completions, Responses; clients skip it), Anthropic's `ping` event on its
Messages route. A proxy cuts a stream that stays silent too long, and a stream can while its request
runs: a tool call is sent whole, at its end, and a reasoning parser may hold text back. Each route passes
what it is about to send for a chunk of the generation through `Keepalive.events`: one rule and one
interval for every stream."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

KEEPALIVE_SECONDS = 5.0
SSE_COMMENT = b": keepalive\n\n"


class Keepalive:
    """One stream's silence: `beat` is what it sends after KEEPALIVE_SECONDS of nothing (bytes, or a
    callable that makes them: a route's own event)."""

    def __init__(self, beat: bytes | Callable[[], Any]):
        self.beat = beat
        self.quiet_since = time.monotonic()

    def events(self, events: list) -> list:
        """`events` (what the stream sends for this chunk); where there are none and the stream has sent
        nothing for KEEPALIVE_SECONDS, the beat."""
        now = time.monotonic()
        if not events and now - self.quiet_since > KEEPALIVE_SECONDS:
            events = [self.beat() if callable(self.beat) else self.beat]
        if events:
            self.quiet_since = now
        return events
