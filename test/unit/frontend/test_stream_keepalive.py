"""The one keep-alive rule of the streaming routes (`entrypoints/stream_keepalive.py`): a chunk's events go
as they are and restart the silence; a chunk with none sends the beat only once the stream has been
silent for KEEPALIVE_SECONDS, then waits as long again. The routes' own streams: test_tool_call_parser.py
(chat), test_responses_api.py, test_anthropic_api.py."""

from __future__ import annotations

from sglang.srt.entrypoints import stream_keepalive
from sglang.srt.entrypoints.stream_keepalive import SSE_COMMENT, Keepalive
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")


def test_the_beat_comes_after_the_interval_of_silence_only(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(stream_keepalive.time, "monotonic", lambda: now[0])
    keepalive = Keepalive(SSE_COMMENT)
    now[0] += 4.0
    assert keepalive.events([]) == []  # (quiet for 4 s of 5)
    assert keepalive.events([b"data: 1\n\n"]) == [b"data: 1\n\n"]  # an event restarts the silence
    now[0] += 4.0
    assert keepalive.events([]) == []
    now[0] += 1.5
    assert keepalive.events([]) == [SSE_COMMENT]  # 5.5 s since the last event
    now[0] += 1.0
    assert keepalive.events([]) == []  # (the beat restarted it too)
    made = []
    ping = Keepalive(lambda: made.append(1) or b"event: ping\n\n")
    now[0] += 6.0
    assert ping.events([]) == [b"event: ping\n\n"] and made == [1]  # a route's own event, made when sent
