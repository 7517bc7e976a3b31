"""Stand-ins for PD disaggregation unit tests: a decode server's PD queue with no transfer engine, whose
channel records what it would send instead of sending it, and a prefill server's bare queue. Both are
built without `__init__` and set every field it sets that the tests' paths read (one rank: `SINGLE`)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from sglang.srt.disaggregation.auth import PeerVerifier, PrefillAllowlist
from sglang.srt.disaggregation.decode import DecodeTransferQueue
from sglang.srt.disaggregation.pd_ranks import SINGLE
from sglang.srt.disaggregation.prefill import PrefillBootstrapQueue
from sglang.srt.disaggregation.transfer import PoolLayout


class RecordingChannel:
    def __init__(self):
        self.sent: list[tuple[str, dict]] = []
        self.dropped = 0

    def send(self, url: str, msg: dict) -> bool:
        self.sent.append((url, msg))
        return True

    def close(self) -> None:
        self.closed = True


def decode_queue(sched: Any) -> DecodeTransferQueue:
    """A decode server's PD queue over `sched` (a stand-in scheduler, given a `tree_cache` of None, no
    host tier, if it has none), without a transfer engine."""
    q = DecodeTransferQueue.__new__(DecodeTransferQueue)
    if not hasattr(sched, "tree_cache"):
        sched.tree_cache = None
    q.sched = sched
    q.ranks, q.news, q.now = SINGLE, False, 0.0
    q.rank_targets, q.added_at, q.unsent = [], {}, []
    q.layout, q.model_path = PoolLayout([], [], 0, [], [], []), None
    q.engine = SimpleNamespace(session_id="127.0.0.1:16610")
    q.channel = RecordingChannel()
    q.notify_url = "tcp://127.0.0.1:1"
    q.allowlist = PrefillAllowlist.parse(None)
    q.peers = PeerVerifier(False, q.channel.send, q.notify_url)
    q.prealloc, q.reserved, q.ready = [], [], []
    q.transfers, q.zombies, q.dst_sent = {}, {}, set()
    q.timeout = 300.0
    q.radix = False
    q.staging, q.device_packer, q.staged = None, None, {}
    q.stats = {"transfers": 0, "failed_transfers": 0, "bytes": 0, "kv_tokens": 0, "seconds": 0.0,
               "staged_chunks": 0}  # fmt: skip
    return q


def prefill_queue(sched: Any) -> PrefillBootstrapQueue:
    """A prefill server's PD queue over `sched`, at one rank, with no room, no channel and no transfer
    engine (a test sets those its path needs)."""
    q = PrefillBootstrapQueue.__new__(PrefillBootstrapQueue)
    q.sched = sched
    q.ranks, q.news, q.now = SINGLE, False, 0.0
    q.layout, q.layouts, q.staging = PoolLayout([], [], 0, [], [], []), [], None
    q.model_path, q.decode_tp, q.shard_rule = None, None, None
    q.rooms, q.ended = {}, {}
    q.timeout = 300.0
    q.context_len = 4096
    q.stats = {"transfers": 0, "failed_transfers": 0, "bytes": 0, "kv_tokens": 0, "seconds": 0.0}
    return q
