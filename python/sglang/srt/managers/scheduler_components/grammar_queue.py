"""`GrammarQueue`: requests whose grammar is being compiled (upstream's `grammar_queue`).

A request with a json_schema, regex, ebnf or structural_tag arrives here, not in the waiting queue: its
grammar compiles on the backend's threads while the scheduler goes on with the others. Each step
(`poll`) moves the requests whose grammar is ready (in arrival order among them: a slow grammar holds
up no other) to where they would have gone (`on_ready`: the waiting queue, or a PD decode server's
transfer queue), with their matcher; a grammar that does not parse or compile, or compiles past
SGLANG_GRAMMAR_TIMEOUT, ends its request with a 400 naming the field (a compile still running then
gives its place in the backend's pool up, `constrained/compile_pool.py`). Without a backend
(`--grammar-backend none`, or xgrammar not installed) such a request ends with a 400 at once.

Under tensor parallelism rank 0 decides which requests leave the queue (`settled`, in its tick) and every
rank applies that (`apply`); a compile's outcome is each rank's own, so the ranks agree on which of them
failed (`group`: one gather per tick that has decisions), and a request whose compile failed on any rank
ends on every rank, with the first failing rank's message.

`held` counts the scheduler's requests that hold a matcher (past the queue): while there is one, the
overlap schedule processes every batch in flight before it builds the next (a mask needs the tokens
the last batch sampled), see `Scheduler.step`; a grammar still compiling costs the others no overlap.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from sglang.srt.constrained.grammar_spec import error_text, grammar_key
from sglang.srt.environ import envs

if TYPE_CHECKING:
    from sglang.srt.constrained.reasoning_grammar import ReasoningTokens
    from sglang.srt.constrained.xgrammar_backend import GrammarBackend
    from sglang.srt.managers.schedule_batch import Req


class GrammarQueue:
    def __init__(
        self,
        backend: GrammarBackend | None,
        on_ready: Callable[[Req], None],
        on_error: Callable[[Req, str, str], None],
        disabled_reason: str = "",
        reasoning: ReasoningTokens | None = None,
    ):
        self.backend = backend
        # --reasoning-parser: a request that requires reasoning holds its grammar after it, and under
        # --enable-strict-thinking a `ReasoningGrammar` even without one (constrained/reasoning_grammar.py).
        self.reasoning = reasoning
        self.disabled_reason = disabled_reason  # why there is no backend
        self.on_ready = on_ready
        self.on_error = on_error  # (request, message, field): ends it with a 400
        self.queue: list[tuple[Req, Future, float]] = []  # (request, compile, when it was queued)
        self.held = 0  # requests holding a matcher
        # Tensor parallelism: the scheduler's gloo group, over which the ranks agree on the compiles that
        # failed (`apply`); None on one rank.
        self.group: Any = None

    @property
    def live(self) -> int:
        """The requests with a grammar: queued, or holding a matcher."""
        return len(self.queue) + self.held

    def __len__(self) -> int:
        return len(self.queue)

    def add(self, req: Req) -> bool:
        """Take `req` if it has a grammar (True); else leave it to the caller (False)."""
        key = grammar_key(req.sampling_params)
        if key is None:
            req.grammar = self._after_reasoning(req, None)
            self.held += req.grammar is not None  # (no compile: it runs as a request without a grammar)
            return False
        if self.backend is None:
            message = f"{key[0]} needs constrained decoding, and {self.disabled_reason}; leave it out."
            self.on_error(req, message, key[0])
            return True
        self.queue.append((req, self.backend.submit(*key), time.monotonic()))
        return True

    def poll(self, block_s: float = 0.0) -> bool:
        """Move the requests whose grammar is done (in arrival order among them; waiting up to `block_s`
        for one if none is), and end those whose grammar compiles past SGLANG_GRAMMAR_TIMEOUT; True if
        any left the queue."""
        if not self.queue:
            return False
        if block_s > 0 and not any(fut.done() for _, fut, _ in self.queue):
            wait([fut for _, fut, _ in self.queue], timeout=block_s, return_when=FIRST_COMPLETED)
        return self.apply(self.settled())

    def settled(self) -> list[tuple[str, bool]]:
        """(rid, timed out) of the queued requests whose compile has ended or run past the timeout, in
        queue order: what `apply` acts on (tensor parallelism: rank 0 decides, every rank applies)."""
        now, timeout = time.monotonic(), envs.SGLANG_GRAMMAR_TIMEOUT.get()
        return [(req.rid, not fut.done()) for req, fut, t in self.queue if fut.done() or now - t > timeout]

    def apply(self, decisions: list[tuple[str, bool]]) -> bool:
        """Take the `decisions`' requests off the queue: a timed-out one ends with a 400, the others get
        their matcher (waiting for a compile that has not ended here yet: on another rank it has)."""
        if not decisions:
            return False
        timed_out = dict(decisions)
        out = [e for e in self.queue if e[0].rid in timed_out]
        # Off the queue before the callbacks: ending a request discards it (`discard`), and must not
        # find it here.
        self.queue = [e for e in self.queue if e[0].rid not in timed_out]
        failed = self._failed([(req.rid, fut) for req, fut, _ in out if not timed_out[req.rid]])
        for req, fut, _ in out:
            kind = grammar_key(req.sampling_params)[0]
            if timed_out[req.rid]:
                self.backend.abandon(fut)  # (one already running finishes on its thread, for nobody)
                timeout = envs.SGLANG_GRAMMAR_TIMEOUT.get()
                message = f"{kind} took more than SGLANG_GRAMMAR_TIMEOUT ({timeout:g} s) to compile."
                self.on_error(req, message, kind)
            elif req.rid in failed:
                self.on_error(req, f"{kind} could not be compiled: {failed[req.rid]}.", kind)
            else:
                req.grammar = self._after_reasoning(req, self.backend.matcher(fut.result()))
                self.held += 1
                self.on_ready(req)
        return True

    def _after_reasoning(self, req: Req, grammar: Any) -> Any:
        """What `req` holds: `grammar` (None: none), after its reasoning where it requires some."""
        if self.reasoning is None or not req.require_reasoning:
            return grammar
        return self.reasoning.grammar(grammar, (req.sampling_params.custom_params or {}).get("thinking_budget"))

    def _failed(self, compiles: list[tuple[str, Future]]) -> dict[str, str]:
        """rid -> why its compile failed, of `compiles` (waited for): here, or under TP on any rank (one
        gather of the ranks' failures; the first failing rank's words)."""
        mine = {rid: error_text(fut.exception()) for rid, fut in compiles if fut.exception() is not None}
        if self.group is None:
            return mine
        everyone: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(everyone, mine, group=self.group)
        failed: dict[str, str] = {}
        for failures in everyone:
            for rid, why in failures.items():
                failed.setdefault(rid, why)
        return failed

    @property
    def requests(self) -> list[Req]:
        return [req for req, _, _ in self.queue]

    def discard(self, req: Req) -> None:
        """`req` left the scheduler (finished, aborted)."""
        for i, (queued, fut, _) in enumerate(self.queue):
            if queued is req:
                self.backend.abandon(fut)
                del self.queue[i]
                return
        if req.grammar is not None:
            self.held -= 1
            req.grammar = None

    def check(self, holders: Sequence[Req]) -> None:
        """`held` counts the scheduler's requests that hold a matcher."""
        held = sum(r.grammar is not None for r in holders)
        assert self.held == held, f"grammar matchers counted {self.held}, held {held}"
