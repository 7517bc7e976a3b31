"""Sessions (upstream's `/open_session`, `/close_session` and /generate's `session_params`).

A session keeps the token ids of its requests in a tree: a request that names an earlier one of its
session (`session_params.rid`) continues it, its prompt being that request's input and output ids (its
input only with `drop_previous_output`), cut to `[:offset]` when `offset` is set and not 0, then the new
input (a leading BOS dropped). `replace` forgets the named request's later turns (aborting those still
running), or with no rid every turn of the session; a request with no rid starts a new root.

The TokenizerManager owns the sessions: it builds a session request into its whole prompt here and sends
it as any other, so tensor and data parallelism need nothing more, and the prefix cache reuses the earlier
turn's KV and recurrent state (its snapshot at the last cache boundary the turn reached). Upstream's
streaming sessions, which hold a request's KV and state slot between turns, are not built: `streaming`
is refused with a sentence, as `--enable-streaming-session` is at start.

Bounds (a client could otherwise make the process hold any number of token lists): the open sessions
(`SGLANG_MAX_OPEN_SESSIONS`), and over all sessions the requests kept (`SGLANG_SESSION_MAX_REQUESTS`)
and their token ids (`SGLANG_SESSION_MAX_TOKENS`, 4 bytes each). A session with a `timeout` closes once
that many seconds pass without a request.
"""

from __future__ import annotations

import math
import time
import uuid
from array import array
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.environ import envs
from sglang.srt.managers.request_error import RequestError

PARAMS = ("id", "rid", "offset", "replace", "drop_previous_output")
MAX_SESSION_ID_LEN = 256
STREAMING_REFUSED = (
    "streaming sessions are not supported by this server (it keeps a session's token ids, and the prefix "
    "cache reuses each turn's state); leave streaming out or send false."
)


@dataclass(eq=False)
class Turn:
    """One request of a session: its input ids, then (once it ended) its output ids."""

    rid: str
    parent: Turn | None
    ids: array
    input_len: int
    done: bool = False
    live: bool = True  # False once replaced away or its session closed: it counts nowhere
    children: list[Turn] = field(default_factory=list)


@dataclass(eq=False)
class Session:
    session_id: str
    timeout: float | None
    last_active: float
    turns: dict[str, Turn] = field(default_factory=dict)


@dataclass(eq=False)
class SessionPlan:
    """What one prompt's `session_params` asked, checked when the request was built; `turn` is set
    when the request is sent."""

    session: Session
    parent: Turn | None
    replace: bool
    turn: Turn | None = None


class SessionController:
    def __init__(self, refusal: str | None = None, bos_token_id: int | None = None):
        self.refusal = refusal  # why this server opens no session (PD disaggregation), or None
        self.bos_token_id = bos_token_id
        self.sessions: dict[str, Session] = {}
        self.max_sessions = envs.SGLANG_MAX_OPEN_SESSIONS.get()
        self.max_turns = envs.SGLANG_SESSION_MAX_REQUESTS.get()
        self.max_tokens = envs.SGLANG_SESSION_MAX_TOKENS.get()
        self.num_turns = 0
        self.num_tokens = 0

    # ---- open and close --------------------------------------------------------------------------

    def open(self, obj: Any) -> str:
        """A new session's id (the one asked for, or a fresh one); RequestError naming the field."""
        if self.refusal is not None:
            raise RequestError(self.refusal, "session_id")
        capacity = obj.capacity_of_str_len
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            raise RequestError(
                "capacity_of_str_len must be an integer >= 0.", "capacity_of_str_len", "invalid_type"
            )
        if obj.streaming not in (None, False):
            raise RequestError(STREAMING_REFUSED, "streaming", "unsupported_parameter")
        timeout = obj.timeout
        if timeout is not None and (
            isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf
        ):
            raise RequestError("timeout must be a number of seconds > 0, or null.", "timeout", "invalid_type")
        sid = obj.session_id
        if sid is None:
            sid = uuid.uuid4().hex
        elif not isinstance(sid, str) or not 0 < len(sid) <= MAX_SESSION_ID_LEN or not sid.isprintable():
            message = f"session_id must be 1-{MAX_SESSION_ID_LEN} printable characters, or null."
            raise RequestError(message, "session_id", "invalid_type")
        now = time.monotonic()
        self._reap(now)
        if sid in self.sessions:
            raise RequestError(f"A session with id {sid!r} is already open; close it first.", "session_id")
        if len(self.sessions) >= self.max_sessions:
            message = f"{len(self.sessions)} sessions are open, the most this server keeps "
            message += "(SGLANG_MAX_OPEN_SESSIONS); close one first."
            raise RequestError(message, "session_id")
        self.sessions[sid] = Session(sid, None if timeout is None else float(timeout), now)
        return sid

    def close(self, session_id: Any) -> bool:
        """Forget a session (its running requests go on; nothing more continues them): whether it was open."""
        session = self.sessions.pop(session_id, None) if isinstance(session_id, str) else None
        if session is None:
            return False
        self._drop(list(session.turns.values()))
        return True

    # ---- requests ------------------------------------------------------------------------------

    def build_prompts(
        self, value: Any, prompts: Any, encoded: list[Any], media: bool
    ) -> list[SessionPlan | None]:
        """Each prompt's plan, and its whole prompt put in `prompts.ids` (history, then its own ids);
        `encoded[i]` are the tokens of `prompts.texts[i]`, and both lists lose the prompts rebuilt."""
        num = len(prompts.ids)
        per_prompt = value if isinstance(value, list) else [value] * num
        if len(per_prompt) != num:
            message = f"session_params must be one object, or a list with one per prompt ({num}), got {len(per_prompt)}."
            raise RequestError(message, "session_params")
        if media and any(p is not None for p in per_prompt):
            message = "session_params cannot be combined with image_data or video_data: a session keeps token ids only."
            raise RequestError(message, "session_params")
        self._reap(time.monotonic())
        plans: list[SessionPlan | None] = []
        texts, kept = iter(zip(prompts.texts, encoded, strict=True)), ([], [])
        for i, params in enumerate(per_prompt):
            ids = prompts.ids[i]
            if ids is None:
                text, enc = next(texts)
                if params is None or enc.ids is None:  # (too long: build_requests says so)
                    kept[0].append(text)
                    kept[1].append(enc)
                    plans.append(None)
                    continue
                ids = enc.ids
            if params is None:
                plans.append(None)
                continue
            plan, history = self._plan(params, num)
            if not isinstance(ids, list):
                raise RequestError("input_ids must be a list of token ids.", "input_ids", "invalid_type")
            if history and ids and ids[0] == self.bos_token_id:
                ids = ids[1:]  # (upstream's rule: the history has its BOS already)
            prompts.ids[i] = history + ids
            plans.append(plan)
        prompts.texts[:], encoded[:] = kept
        return plans

    def begin(self, plans: list[SessionPlan | None], rids: list[str], inputs: list[list[int]]) -> list[str]:
        """Record the requests about to be sent as turns of their sessions (checked again: a close or a
        replace may have come meanwhile); returns the rids of running turns a replace removed, to abort."""
        now = time.monotonic()
        self._reap(now)
        new_turns = new_tokens = 0
        for plan, ids in zip(plans, inputs, strict=True):
            if plan is None:
                continue
            session = plan.session
            if self.sessions.get(session.session_id) is not session:
                raise RequestError(f"Session {session.session_id!r} was closed.", "session_params.id")
            if plan.parent is not None and not plan.parent.live:
                raise RequestError(
                    f"Request {plan.parent.rid!r} of session {session.session_id!r} was replaced.",
                    "session_params.rid",
                )
            new_turns += 1
            new_tokens += len(ids)
        for plan, rid in zip(plans, rids, strict=True):
            if plan is not None and rid in plan.session.turns:
                message = f"rid {rid!r} names a request of session {plan.session.session_id!r} already; send a new rid."
                raise RequestError(message, "rid")
        if self.num_turns + new_turns > self.max_turns or self.num_tokens + new_tokens > self.max_tokens:
            message = (
                f"Sessions hold {self.num_turns} requests and {self.num_tokens} tokens, the most this server "
            )
            message += "keeps (SGLANG_SESSION_MAX_REQUESTS, SGLANG_SESSION_MAX_TOKENS); close sessions first."
            raise RequestError(message, "session_params")
        to_abort: list[str] = []
        for plan, rid, ids in zip(plans, rids, inputs, strict=True):
            if plan is None:
                continue
            session, parent = plan.session, plan.parent
            session.last_active = now
            if plan.replace:
                removed = list(session.turns.values()) if parent is None else _subtree(parent.children)
                to_abort += [t.rid for t in removed if not t.done]
                for t in removed:
                    session.turns.pop(t.rid, None)
                self._drop(removed)
                if parent is not None:
                    parent.children.clear()
            turn = Turn(rid, parent, array("i", ids), len(ids))
            session.turns[rid] = turn
            if parent is not None:
                parent.children.append(turn)
            plan.turn = turn
            self.num_turns += 1
            self.num_tokens += len(ids)
        return to_abort

    def end(self, plan: SessionPlan | None, output_ids: list[int]) -> None:
        """A request ended (finished, aborted, or its client left): its turn keeps what it output."""
        turn = None if plan is None else plan.turn
        if turn is None or turn.done:
            return
        turn.done = True
        if turn.live:
            turn.ids.extend(output_ids)
            self.num_tokens += len(output_ids)

    # ---- internals -----------------------------------------------------------------------------

    def _plan(self, params: Any, num_prompts: int) -> tuple[SessionPlan, list[int]]:
        if not isinstance(params, dict):
            raise RequestError(
                "session_params must be an object (or a list of them).", "session_params", "invalid_type"
            )
        for key in params:
            if key not in PARAMS:
                message = f"session_params.{key} is not a session parameter ({', '.join(PARAMS)})."
                raise RequestError(message, f"session_params.{key}")
        sid, rid, offset = params.get("id"), params.get("rid"), params.get("offset")
        replace, drop_output = params.get("replace"), params.get("drop_previous_output")
        if not isinstance(sid, str) or not sid:
            raise RequestError(
                "session_params.id must name an open session.", "session_params.id", "invalid_type"
            )
        if rid is not None and not isinstance(rid, str):
            raise RequestError(
                "session_params.rid must be a string or null.", "session_params.rid", "invalid_type"
            )
        if offset is not None and (isinstance(offset, bool) or not isinstance(offset, int)):
            raise RequestError(
                "session_params.offset must be an integer or null.", "session_params.offset", "invalid_type"
            )
        for name, flag in (("replace", replace), ("drop_previous_output", drop_output)):
            if flag is not None and not isinstance(flag, bool):
                raise RequestError(
                    f"session_params.{name} must be a boolean.", f"session_params.{name}", "invalid_type"
                )
        session = self.sessions.get(sid)
        if session is None:
            raise RequestError(
                f"Session {sid!r} does not exist (never opened, closed, or timed out).", "session_params.id"
            )
        if replace and num_prompts > 1:
            message = "session_params.replace applies to a request of one prompt (a batch's turns would replace each other)."
            raise RequestError(message, "session_params.replace")
        parent = None
        history: list[int] = []
        if rid is not None:
            parent = session.turns.get(rid)
            if parent is None:
                message = f"Request {rid!r} is not in session {sid!r} (never sent with it, or replaced)."
                raise RequestError(message, "session_params.rid")
            if not parent.done:
                raise RequestError(
                    f"Request {rid!r} of session {sid!r} has not finished.", "session_params.rid"
                )
            history = (parent.ids[: parent.input_len] if drop_output else parent.ids).tolist()
            if offset:
                history = history[:offset]
        return SessionPlan(session, parent, bool(replace)), history

    def _drop(self, turns: list[Turn]) -> None:
        for t in turns:
            if t.live:
                t.live = False
                self.num_turns -= 1
                self.num_tokens -= len(t.ids)

    def _reap(self, now: float) -> None:
        expired = [
            s.session_id
            for s in self.sessions.values()
            if s.timeout is not None and now - s.last_active > s.timeout
        ]
        for sid in expired:
            self.close(sid)


def _subtree(children: list[Turn]) -> list[Turn]:
    out, stack = [], list(children)
    while stack:
        t = stack.pop()
        out.append(t)
        stack += t.children
    return out
