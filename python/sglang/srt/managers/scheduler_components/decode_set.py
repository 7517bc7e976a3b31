"""Which running requests decode a token at a step (upstream: the running batch after `filter_batch`),
and `DecodeSetCache`, which answers it without re-reading what cannot have changed.

A running request decodes when it is not finished, has sampled at least one token (or has one in flight)
and fewer than its max_new_tokens, its prefill is done, and its KV is below the context length. A PD
prefill server hands a disaggregated request over after its prompt and never decodes it.
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter

from sglang.srt.managers.schedule_batch import Req


def select_decode_reqs(running: list[Req], context_len: int, prefill_server: bool) -> list[Req]:
    # Req's properties (finished, planned_output_len, prefill_done, kv_len) spelled out.
    return [
        r
        for r in running
        if r.finished_reason is None
        and 0 < len(r.output_ids) + r.inflight_tokens < r.sampling_params.max_new_tokens
        and r.fill_ids
        and len(r.fill_ids) <= len(r.kv_indices) < context_len
        and not (prefill_server and r.bootstrap is not None)
    ]


def decode_steps_left(req: Req, context_len: int) -> int:
    """How many decode batches in a row a selected request stays selected for: each adds one planned
    output token and one KV slot (its output and context budgets)."""
    return min(
        req.sampling_params.max_new_tokens - len(req.output_ids) - req.inflight_tokens,
        context_len - len(req.kv_indices),
    )


_decode_until = attrgetter("decode_until")


class DecodeSetCache:
    """`select_decode_reqs` that reads each request in full once, when it first qualifies: it then
    holds a certificate, `req.decode_until`, the number of decode builds after which it stops
    qualifying, and later builds read only that and whether it finished.

    Why a certificate holds: a request that qualifies is in every decode batch built while it does, and
    each adds exactly one planned token and one KV slot; processing moves tokens from in flight to
    committed (the planned count stays); a request that finishes, is aborted or is retracted leaves the
    running list, and a retracted one drops its certificate (`Req.reset_for_retract`: its prefill
    again will sample a token outside any decode batch). A request that does not qualify is read in
    full at each build (few do: those whose last token is in flight, and on a PD prefill server the
    disaggregated ones between their prompt and their handoff).

    While the running list is the very one of the previous build (same requests, same order) and no
    certificate has run out, the selection is the previous one: one list comparison per steady step."""

    def __init__(self, context_len: int, prefill_server: bool, enabled: bool = True):
        self.context_len = context_len
        self.prefill_server = prefill_server
        self.enabled = enabled  # False: every build reads every request (`select_decode_reqs`)
        self.builds = 0  # decode builds so far: the clock of `decode_until`
        self._running: list[Req] = []
        self._reqs: list[Req] = []
        self._min_until = 0

    def select(self, running: list[Req], before_read: Callable[[], None] | None = None) -> list[Req]:
        """The requests of this decode build (a list of the caller's own). `before_read` runs before a
        selection that reads the requests' lists (`DecodeFastPath.flush`: the steps they lack go in)."""
        now = self.builds
        self.builds += 1
        if self.enabled and self._reqs and now < self._min_until and running == self._running:
            return list(self._reqs)
        if before_read is not None:
            before_read()
        if not self.enabled:
            return select_decode_reqs(running, self.context_len, self.prefill_server)
        qualifies = self._qualifies
        reqs = [
            r for r in running if (r.decode_until > now and r.finished_reason is None) or qualifies(r, now)
        ]
        self._running, self._reqs = list(running), reqs
        self._min_until = min(map(_decode_until, reqs), default=0)
        return list(reqs)

    def _qualifies(self, req: Req, now: int) -> bool:
        if not select_decode_reqs([req], self.context_len, self.prefill_server):
            return False
        req.decode_until = now + decode_steps_left(req, self.context_len)
        return True

    def clear(self) -> None:
        self._running, self._reqs, self._min_until = [], [], 0
