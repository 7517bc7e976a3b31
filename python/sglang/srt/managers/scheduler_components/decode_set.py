"""Which running requests decode a token at a step (upstream: the running batch after `filter_batch`),
and `DecodeSetCache`, which keeps that answer while it cannot change.

A running request decodes when it is not finished, has sampled at least one token (or has one in flight)
and fewer than its max_new_tokens, its prefill is done, and its KV is below the context length. A PD
prefill server hands a disaggregated request over after its prompt and never decodes it.
"""

from __future__ import annotations

from sglang.srt.managers.schedule_batch import Req


def select_decode_reqs(running: list[Req], context_len: int, prefill_server: bool) -> list[Req]:
    # One pass over every running request at every step, so Req's properties (finished,
    # planned_output_len, prefill_done, kv_len) are spelled out.
    return [
        r
        for r in running
        if r.finished_reason is None
        and 0 < len(r.output_ids) + r.inflight_tokens < r.sampling_params.max_new_tokens
        and r.fill_ids
        and len(r.fill_ids) <= len(r.kv_indices) < context_len
        and not (prefill_server and r.bootstrap is not None)
    ]


def decode_steps_left(reqs: list[Req], context_len: int) -> int:
    """How many more decode batches of all of `reqs` each request stays selected for: every such batch
    adds one planned output token and one KV slot to each (its output and context budgets)."""
    return min(
        (
            min(
                r.sampling_params.max_new_tokens - len(r.output_ids) - r.inflight_tokens,
                context_len - len(r.kv_indices),
            )
            for r in reqs
        ),
        default=0,
    )


class DecodeSetCache:
    """`select_decode_reqs` without its pass over the running requests while the running list is the same
    one (same requests, same order) as at the previous decode build: every step of a steady decode.

    Why the answer holds then: between two decode builds with the same running list, each selected
    request went through exactly one decode batch (one more planned token and KV slot), processing moves
    tokens from in flight to committed (the planned count stays), and a request that finishes, is
    aborted or retracted leaves the running list (on a PD prefill server a finished disaggregated
    request may stay until its transfer ends, so it is not cached there). A request not selected stays
    so: the reasons only grow (outputs, KV) or end with its leaving. So the selection is the previous
    one for `decode_steps_left` steps, counted once the list is seen the same twice (a list that changes
    at every step, under arrivals and finishes, costs one comparison: lengths differ, or the first
    different request)."""

    def __init__(self, context_len: int, prefill_server: bool):
        self.context_len = context_len
        self.prefill_server = prefill_server
        self._running: list[Req] = []
        self._reqs: list[Req] = []
        self._steps_left: int | None = None

    def select(self, running: list[Req]) -> list[Req]:
        """The requests of this step's decode batch (a list of the caller's own)."""
        if not self.prefill_server and self._reqs and running == self._running:
            if self._steps_left is None:
                self._steps_left = decode_steps_left(self._reqs, self.context_len)
            if self._steps_left > 0:
                self._steps_left -= 1
                return list(self._reqs)
        reqs = select_decode_reqs(running, self.context_len, self.prefill_server)
        self._running, self._reqs, self._steps_left = list(running), reqs, None
        return list(reqs)

    def clear(self) -> None:
        self._running, self._reqs, self._steps_left = [], [], None
