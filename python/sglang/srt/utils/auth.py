"""API keys per route, as upstream's (`--api-key`, `--admin-api-key` and its three levels).

A route's level is set on its endpoint (`auth_level`); `decide_request_auth` says who may call it:
- `NORMAL` (generation, model and server info): with `--api-key`, that key; else open.
- `ADMIN_OPTIONAL` (weights, memory, pause and continue, abort, flush, weight version): with
  `--admin-api-key`, that key only (the user key is refused there); else as `NORMAL`.
- `ADMIN_FORCE`: the admin key only; refused (403) on a server started without one.
As upstream, each key opens its own routes: with both keys set, `NORMAL` routes take the user key only.
`/health` is always open (load balancers' probes). Keys are compared in constant time.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from enum import Enum
from typing import Any, TypeVar

from starlette.routing import Match

from sglang.srt.utils.error_body import is_anthropic_path

F = TypeVar("F", bound=Callable[..., Any])

OPEN_PATHS = ("/health",)


class AuthLevel(str, Enum):
    NORMAL = "normal"
    ADMIN_OPTIONAL = "admin_optional"
    ADMIN_FORCE = "admin_force"


_RANK = {AuthLevel.NORMAL: 0, AuthLevel.ADMIN_OPTIONAL: 1, AuthLevel.ADMIN_FORCE: 2}


def auth_level(level: AuthLevel) -> Callable[[F], F]:
    """Mark an endpoint with its level (unmarked endpoints are `NORMAL`)."""

    def mark(endpoint: F) -> F:
        endpoint._auth_level = level  # type: ignore[attr-defined]
        return endpoint

    return mark


def _bearer_matches(authorization: bytes | None, key: str) -> bool:
    if authorization is None:
        return False
    scheme, _, token = authorization.partition(b" ")
    # On bytes: compare_digest refuses str with characters outside ASCII, which a header may carry.
    return scheme.lower() == b"bearer" and secrets.compare_digest(token, key.encode())


def decide_request_auth(
    level: AuthLevel, authorization: bytes | None, api_key: str | None, admin_api_key: str | None
) -> int | None:
    """None where the request may go on, else the status to refuse it with (401, or 403 for an
    `ADMIN_FORCE` route on a server without an admin key)."""
    if level is AuthLevel.ADMIN_FORCE and not admin_api_key:
        return 403
    if level is not AuthLevel.NORMAL and admin_api_key:
        return None if _bearer_matches(authorization, admin_api_key) else 401
    if api_key:
        return None if _bearer_matches(authorization, api_key) else 401
    return None


def route_level(routes: Iterable[Any], scope: dict[str, Any]) -> AuthLevel:
    """The highest level among the routes whose path matches (whatever the method: a route asked with
    the wrong method answers 405 only to those who may call it)."""
    level = AuthLevel.NORMAL
    for route in routes:
        match, _ = route.matches(scope)
        if match is not Match.NONE:
            marked = getattr(getattr(route, "endpoint", None), "_auth_level", AuthLevel.NORMAL)
            level = max(level, marked, key=_RANK.__getitem__)
    return level


class ApiKeyCheck:
    """Who may call what (`decide_request_auth` per route level), asked by the request guard before it
    reads a body: a client without the key gets its 401 at once, whatever body it announced or sends (a
    body limit's worth of it was read before)."""

    def __init__(self, routes: list[Any], api_key: str | None, admin_api_key: str | None):
        self.routes = routes  # the router's list: routes added later are seen too
        self.api_key = api_key
        self.admin_api_key = admin_api_key

    def refusal(self, scope: dict[str, Any]) -> tuple[int, str, str] | None:
        """None where the request may go on, else (status, message, OpenAI's error code)."""
        if scope["path"] in OPEN_PATHS:
            return None
        authorization = next((v for k, v in scope["headers"] if k == b"authorization"), None)
        anthropic = is_anthropic_path(scope["path"])
        if authorization is None and anthropic:
            # Anthropic's clients send the key as x-api-key (and as a bearer token with an auth token set).
            key = next((v for k, v in scope["headers"] if k == b"x-api-key"), None)
            authorization = None if key is None else b"Bearer " + key
        level = route_level(self.routes, scope)
        status = decide_request_auth(level, authorization, self.api_key, self.admin_api_key)
        if status is None:
            return None
        code = "forbidden" if status == 403 else "invalid_api_key"
        message = _refusal_message(status, level, self.admin_api_key)
        if anthropic:  # (their clients send the key as x-api-key)
            message = message.replace("(Authorization: Bearer ...)", "(x-api-key, or Authorization: Bearer ...)")
        return status, message, code


def _refusal_message(status: int, level: AuthLevel, admin_api_key: str | None) -> str:
    if status == 403:
        return "This route is open only on a server started with --admin-api-key."
    if level is not AuthLevel.NORMAL and admin_api_key:
        return "This route needs the admin API key (--admin-api-key) as Authorization: Bearer ...."
    return "Invalid or missing API key (Authorization: Bearer ...)."
