"""What the HTTP server does before a route sees a request: body size and read deadlines, clients that
go away, and each request's route, method and status (for metrics: `HttpObserver`).

`RequestGuard` (ASGI middleware) reads each request body itself, so that
  - a request without the API key its route asks for (`authorize`: utils.auth.ApiKeyCheck) gets its 401
    before any of its body is read;
  - a body larger than the limit is refused with 413 before it is read whole (at once when its
    Content-Length says so, else as soon as the bytes read pass the limit);
  - a client that stalls mid-body longer than the read timeout gets 408 and its connection closes;
  - a client that goes away mid-body is not a server error: no traceback, counted as 499 (nginx's
    "client closed request");
and routes then read the body from memory. `TimedH11Protocol` closes connections that do not send a
complete request head within the read timeout (uvicorn's keep-alive timer only runs between requests,
so a client that connects and sends nothing, or half a head, would hold its connection forever).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

import orjson
from starlette.routing import Match
from uvicorn.protocols.http.h11_impl import H11Protocol

from sglang.srt.utils.error_body import body_for_path

CLIENT_CLOSED = 499

Scope = dict[str, Any]
Message = dict[str, Any]
# The endpoint label of a path no route serves: a client's paths would otherwise each add a series.
UNMATCHED = "unmatched"


class HttpObserver(Protocol):
    """Told of each HTTP request as it starts and as it ends (with its status), by route template (a
    path no route matches is `UNMATCHED`)."""

    def on_http_request(self, endpoint: str, method: str) -> None: ...

    def on_http_response(self, endpoint: str, method: str, status_code: int) -> None: ...

    def on_http_done(self, endpoint: str, method: str) -> None: ...


class RequestGuard:
    def __init__(
        self,
        app: Any,
        max_body_bytes: int,
        read_timeout: float,
        on_response: Callable[[int], None] | None = None,
        observer: HttpObserver | None = None,
        authorize: Callable[[Scope], tuple[int, str, str] | None] | None = None,
    ):
        self.app = app
        self.authorize = authorize  # None, or (status, message, code) to refuse with
        self.max_body_bytes = max_body_bytes
        self.read_timeout = read_timeout
        self.on_response = on_response
        self.observer = observer

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.observer is None:
            await self._guard(scope, receive, send, None)
            return
        route = (_endpoint(self.app, scope), scope["method"])
        self.observer.on_http_request(*route)
        try:
            await self._guard(scope, receive, send, route)
        finally:
            self.observer.on_http_done(*route)

    async def _guard(self, scope: Scope, receive: Any, send: Any, route: tuple[str, str] | None) -> None:
        refusal = self.authorize(scope) if self.authorize is not None else None
        if refusal is not None:
            await self._refuse(send, *refusal, route, scope["path"])
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await self._refuse(
                send, 413, self._too_large(f"{declared} bytes"), "request_too_large", route, scope["path"]
            )
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.read_timeout)
            except asyncio.TimeoutError:
                text = f"The request body was not received within {self.read_timeout:g} s."
                await self._refuse(send, 408, text, "request_timeout", route, scope["path"])
                return
            if message["type"] == "http.disconnect":
                self._record(CLIENT_CLOSED, route)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                text = self._too_large(f"more than {size} bytes")
                await self._refuse(send, 413, text, "request_too_large", route, scope["path"])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        pending = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replay() -> Message:
            return pending.pop() if pending else await receive()

        status: list[int] = []

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, replay, send_and_record)
        finally:
            self._record(status[0] if status else CLIENT_CLOSED, route)

    def _too_large(self, size: str) -> str:
        return (
            f"The request body ({size}) is larger than the limit of {self.max_body_bytes} bytes "
            "(--max-request-body-size)."
        )

    async def _refuse(
        self, send: Any, status: int, message: str, code: str, route: tuple[str, str] | None, path: str = ""
    ) -> None:
        body = orjson.dumps(body_for_path(path, message, code, "invalid_request_error", status))
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            # The rest of the body is not read, so the connection cannot carry another request.
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})
        self._record(status, route)

    def _record(self, status: int, route: tuple[str, str] | None) -> None:
        if self.on_response is not None:
            self.on_response(status)
        if self.observer is not None and route is not None:
            self.observer.on_http_response(*route, status)


def _endpoint(app: Any, scope: Scope) -> str:
    """The template of the route that serves the path (upstream's endpoint label), or UNMATCHED. A
    route that has the path for another method counts: the 405 is that route's."""
    for route in getattr(app, "routes", ()):
        match, _ = route.matches(scope)
        if match != Match.NONE:
            return getattr(route, "path", UNMATCHED)
    return UNMATCHED


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # h11 refuses such a request before it gets here
    return None


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request head (`head_timeout` seconds from the
    connection, or from the end of the previous response)."""

    head_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_deadline: asyncio.TimerHandle | None = None
        self._arm_head_deadline()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self._waiting_for_head():
            self._cancel_head_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._waiting_for_head():
            self._arm_head_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_head_deadline()
        super().connection_lost(exc)

    def _waiting_for_head(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm_head_deadline(self) -> None:
        self._cancel_head_deadline()
        self._head_deadline = self.loop.call_later(self.head_timeout, self._on_head_deadline)

    def _cancel_head_deadline(self) -> None:
        if getattr(self, "_head_deadline", None) is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _on_head_deadline(self) -> None:
        self._head_deadline = None
        if self._waiting_for_head():
            self.timeout_keep_alive_handler()  # closes the connection, as uvicorn's keep-alive does


def timed_h11_protocol(head_timeout: float) -> type[TimedH11Protocol]:
    return type("TimedH11Protocol", (TimedH11Protocol,), {"head_timeout": head_timeout})
