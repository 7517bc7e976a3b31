"""Sessions (upstream's `/open_session`, `/close_session` and /generate's `session_params`).

A session keeps the token ids of its requests in a tree: a request that names an earlier one of its
session (`session_params.rid`) continues it, its prompt being that request's input and output ids (its
input only with `drop_previous_output`), cut to `[:offset]` when `offset` is set and not 0, then the new
input (a leading BOS dropped). `replace` forgets the named request's later turns (aborting those still
running), or with no rid every turn of the session; a request with no rid starts a new root. Each turn
keeps only its own ids and where it branches off its parent, so a conversation's history is held once.

The TokenizerManager owns the sessions: it builds a session request into its whole prompt here and sends
it as any other (under data parallelism to its session's replica), so the scheduler needs nothing more,
and the prefix cache reuses the earlier turn's KV and recurrent state (every strategy keeps a finished
request's state at its end). Upstream's streaming sessions, which hold a request's KV and state slot
between turns, are not built: `streaming` is refused with a sentence, as `--enable-streaming-session` is
at start.

Bounds (a client could otherwise make the process hold any number of token lists): the open sessions
(`SGLANG_MAX_OPEN_SESSIONS`), and over all sessions the requests kept (`SGLANG_SESSION_MAX_REQUESTS`)
and their token ids (`SGLANG_SESSION_MAX_TOKENS`, 4 bytes each; a running turn counts its
`max_new_tokens` until it ends). A session with a `timeout` closes once that many seconds pass with no
request running and none sent.
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
from sglang.srt.managers.request_validation import check_input_len

PARAMS = ("id", "rid", "offset", "replace", "drop_previous_output")
MAX_SESSION_ID_LEN = 256
STREAMING_REFUSED = (
    "streaming sessions are not supported by this server (it keeps a session's token ids, and the prefix "
    "cache reuses each turn's state); leave streaming out or send false."
)


@dataclass(eq=False)
class Session:
    session_id: str
    timeout: float | None
    last_active: float
    dp_rank: int | None  # with data parallelism: the replica its turns run on (its cache is there)
    turns: dict[str, Turn] = field(default_factory=dict)
    running: int = 0  # its turns not ended yet (a timeout waits for them)


@dataclass(eq=False)
class Turn:
    """One request of a session. Its whole sequence (prompt, then output) is its parent's first `cut`
    tokens, then `own`: its own input ids (`input_len` of them), then, once it ended, its output ids; so
    the history a conversation repeats in every prompt is kept (and counted) once."""

    rid: str
    session: Session
    parent: Turn | None
    cut: int
    own: array
    input_len: int
    reserved: int  # while running: the output tokens it may add (its max_new_tokens), counted already
    done: bool = False
    live: bool = True  # False once replaced away or its session closed: it counts nowhere
    children: list[Turn] = field(default_factory=list)

    def __len__(self) -> int:
        return self.cut + len(self.own)

    def prefix(self, length: int) -> list[int]:
        """The first `length` tokens of its sequence (walking up its ancestors)."""
        parts, turn = [], self
        while turn is not None and length > 0:
            if length > turn.cut:
                parts.append(turn.own[: length - turn.cut])
                length = turn.cut
            turn = turn.parent
        out = array("i")
        for part in reversed(parts):
            out.extend(part)  # (in C: a long history is copied, not iterated in Python)
        return list(out)


@dataclass(eq=False)
class SessionPlan:
    """What one sample's `session_params` asked, checked when the request was built: its session, the
    turn it continues and how many of that turn's tokens its prompt starts with; `turn` is set when the
    request is sent."""

    session: Session
    parent: Turn | None
    cut: int
    replace: bool
    turn: Turn | None = None


class SessionController:
    def __init__(self, refusal: str | None = None, bos_token_id: int | None = None, dp_size: int = 1):
        self.refusal = refusal  # why this server opens no session (PD disaggregation), or None
        self.bos_token_id = bos_token_id
        self.dp_size = dp_size
        self.next_dp_rank = 0  # sessions go to the replicas in turn
        self.sessions: dict[str, Session] = {}
        self.max_sessions = envs.SGLANG_MAX_OPEN_SESSIONS.get()
        self.max_turns = envs.SGLANG_SESSION_MAX_REQUESTS.get()
        self.max_tokens = envs.SGLANG_SESSION_MAX_TOKENS.get()
        self.num_turns = 0
        self.num_tokens = 0  # the live turns' own ids, and the outputs the running ones may add

    # ---- open and close --------------------------------------------------------------------------

    def open(self, obj: Any) -> str:
        """A new session's id (the one asked for, or a fresh one); RequestError naming the field."""
        if self.refusal is not None:
            raise RequestError(self.refusal, "session_id")
        capacity = obj.capacity_of_str_len
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 0:
            message = "capacity_of_str_len must be an integer >= 0."
            raise RequestError(message, "capacity_of_str_len", "invalid_type")
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
        dp_rank = None
        if self.dp_size > 1:
            dp_rank, self.next_dp_rank = self.next_dp_rank, (self.next_dp_rank + 1) % self.dp_size
        self.sessions[sid] = Session(sid, None if timeout is None else float(timeout), now, dp_rank)
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
        self, value: Any, prompts: Any, encoded: list[Any], media: bool, limits: Any
    ) -> list[SessionPlan | None]:
        """Each prompt's plan, and its whole prompt put in `prompts.ids` (history, then its own ids);
        `encoded[i]` are the tokens of `prompts.texts[i]`, and both lists lose the prompts rebuilt. A
        prompt's plan is shared by its samples: `SessionPlan` copies go to each."""
        num = len(prompts.ids)
        per_prompt = value if isinstance(value, list) else [value] * num
        if len(per_prompt) != num:
            message = f"session_params must be one object, or a list with one per prompt ({num}), "
            raise RequestError(message + f"got {len(per_prompt)}.", "session_params")
        if media and any(per_prompt):
            message = "session_params cannot be combined with image_data or video_data: a session keeps "
            raise RequestError(message + "token ids only.", "session_params")
        self._reap(time.monotonic())
        plans: list[SessionPlan | None] = []
        texts, kept = iter(zip(prompts.texts, encoded, strict=True)), ([], [])
        for i, params in enumerate(per_prompt):
            ids, param = prompts.ids[i], "input_ids"
            if ids is None:
                text, enc = next(texts)
                if not params or enc.ids is None:  # (too long: build_requests says so)
                    kept[0].append(text)
                    kept[1].append(enc)
                    plans.append(None)
                    continue
                ids, param = enc.ids, "text"
            if not params:  # (null or {}: no session, as upstream reads an empty one)
                plans.append(None)
                continue
            plan = self._plan(params)
            if not isinstance(ids, list):
                raise RequestError("input_ids must be a list of token ids.", "input_ids", "invalid_type")
            if plan.parent is not None and ids and ids[0] == self.bos_token_id:
                ids = ids[1:]  # (upstream's rule: the history has its BOS already)
            whole = plan.parent.prefix(plan.cut) + ids if plan.parent is not None else ids
            if not limits.auto_truncate:
                check_input_len(len(whole), limits, param)  # (named as the client sent it)
            prompts.ids[i] = whole
            plans.append(plan)
        prompts.texts[:], encoded[:] = kept
        return plans

    def begin(self, items: list[Any]) -> list[str]:
        """Record the requests about to be sent (`request_validation.NormalizedRequest`s) as turns of
        their sessions, checked again (a close or a replace may have come meanwhile), each sent to its
        session's replica; returns the rids of running turns a replace removed, to abort."""
        now = time.monotonic()
        self._reap(now)
        plans = [item.session for item in items if item.session is not None]
        if len(plans) > 1 and any(plan.replace for plan in plans):
            message = "session_params.replace applies to a request of one prompt and one sample (n=1): "
            message += "its turns would replace each other."
            raise RequestError(message, "session_params.replace")
        new_tokens = 0
        for item in items:
            plan = item.session
            if plan is None:
                continue
            session = plan.session
            if self.sessions.get(session.session_id) is not session:
                raise RequestError(f"Session {session.session_id!r} was closed.", "session_params.id")
            if plan.parent is not None and not plan.parent.live:
                message = f"Request {plan.parent.rid!r} of session {session.session_id!r} was replaced."
                raise RequestError(message, "session_params.rid")
            if item.req.rid in session.turns:
                message = f"rid {item.req.rid!r} names a request of session {session.session_id!r} already; "
                raise RequestError(message + "send a new rid.", "rid")
            new_tokens += len(item.req.input_ids) - min(plan.cut, len(item.req.input_ids)) + _max_new(item)
        # A replace frees what it forgets before the new turn is counted (a client at the bound can roll back).
        removed: list[Turn] = []
        if len(plans) == 1 and plans[0].replace:
            plan = plans[0]
            removed = (
                list(plan.session.turns.values()) if plan.parent is None else _subtree(plan.parent.children)
            )
        freed_tokens = sum(len(t.own) + t.reserved for t in removed)
        if self.num_turns - len(removed) + len(plans) > self.max_turns:
            message = f"Sessions hold {self.num_turns} requests, the most this server keeps "
            message += "(SGLANG_SESSION_MAX_REQUESTS); close sessions first."
            raise RequestError(message, "session_params")
        if self.num_tokens - freed_tokens + new_tokens > self.max_tokens:
            message = (
                f"Sessions hold {self.num_tokens} tokens with the outputs running turns may add, the most "
            )
            message += "this server keeps (SGLANG_SESSION_MAX_TOKENS); close sessions first."
            raise RequestError(message, "session_params")
        to_abort = [t.rid for t in removed if not t.done]
        for t in removed:
            t.session.turns.pop(t.rid, None)
        self._drop(removed)
        for item in items:
            plan = item.session
            if plan is None:
                continue
            session, parent = plan.session, plan.parent
            session.last_active = now
            if plan.replace and parent is not None:
                parent.children.clear()
            ids = item.req.input_ids
            cut = min(plan.cut, len(ids))  # (--allow-auto-truncate may have cut into the history)
            own = array("i", ids[cut:])
            turn = Turn(item.req.rid, session, parent, cut, own, len(own), _max_new(item))
            session.turns[turn.rid] = turn
            session.running += 1
            if parent is not None:
                parent.children.append(turn)
            plan.turn = turn
            item.req.routed_dp_rank = session.dp_rank
            self.num_turns += 1
            self.num_tokens += len(turn.own) + turn.reserved
        return to_abort

    def end(self, plan: SessionPlan | None, output_ids: list[int]) -> None:
        """A request ended (finished, aborted, or its client left): its turn keeps what it output."""
        turn = None if plan is None else plan.turn
        if turn is None or turn.done:
            return
        turn.done = True
        turn.session.running -= 1
        turn.session.last_active = time.monotonic()
        if turn.live:
            output = output_ids[: turn.reserved]  # (never more than it reserved)
            turn.own.extend(output)
            self.num_tokens += len(output) - turn.reserved
        turn.reserved = 0

    # ---- internals -----------------------------------------------------------------------------

    def _plan(self, params: Any) -> SessionPlan:
        if not isinstance(params, dict):
            message = "session_params must be an object (or a list of them)."
            raise RequestError(message, "session_params", "invalid_type")
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
            message = "session_params.offset must be an integer or null."
            raise RequestError(message, "session_params.offset", "invalid_type")
        for name, flag in (("replace", replace), ("drop_previous_output", drop_output)):
            if flag is not None and not isinstance(flag, bool):
                message = f"session_params.{name} must be a boolean."
                raise RequestError(message, f"session_params.{name}", "invalid_type")
        session = self.sessions.get(sid)
        if session is None:
            message = f"Session {sid!r} does not exist (never opened, closed, or timed out)."
            raise RequestError(message, "session_params.id")
        if rid is None:
            return SessionPlan(session, None, 0, bool(replace))
        parent = session.turns.get(rid)
        if parent is None:
            message = f"Request {rid!r} is not in session {sid!r} (never sent with it, or replaced)."
            raise RequestError(message, "session_params.rid")
        if not parent.done:
            raise RequestError(f"Request {rid!r} of session {sid!r} has not finished.", "session_params.rid")
        cut = parent.cut + parent.input_len if drop_output else len(parent)
        if offset:
            cut = len(range(cut)[:offset])  # (Python's slice rule, as upstream cuts the list)
        return SessionPlan(session, parent, cut, bool(replace))

    def _drop(self, turns: list[Turn]) -> None:
        for t in turns:
            if t.live:
                t.live = False
                self.num_turns -= 1
                self.num_tokens -= len(t.own) + t.reserved

    def _reap(self, now: float) -> None:
        expired = [
            s.session_id
            for s in self.sessions.values()
            if s.timeout is not None and s.running == 0 and now - s.last_active > s.timeout
        ]
        for sid in expired:
            self.close(sid)


def _max_new(item: Any) -> int:
    return item.req.sampling_params.max_new_tokens or 0


def _subtree(children: list[Turn]) -> list[Turn]:
    out, stack = [], list(children)
    while stack:
        t = stack.pop()
        out.append(t)
        stack += t.children
    return out
