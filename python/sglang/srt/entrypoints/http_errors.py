"""Every error a route can end with, mapped to a response in one place.

Routes raise; the app's exception handlers (`install_error_handlers`) answer:
- `RequestError` (a field the client got wrong): 400 naming the field;
- `ServerAbortError` (the server ended the request, e.g. a deadline): its status;
- `BackendDeadError` (a child process is gone or stalled) and `TimeoutError` (a control call the
  scheduler did not answer in time): 503;
- `ClientDisconnected`: 499 (nginx's "client closed request"), no body: nobody reads it.
Anything else is a server error (500, logged with its traceback): `ErrorMappingRoute` answers it, since
Starlette's catch-all handler re-raises after answering (uvicorn would log the error twice, and an app
called in process would raise).

A body (`utils.error_body.error_body`; a stream's error event too) carries upstream SGLang's
`ErrorResponse` fields at the top level, `code` being the HTTP status, and OpenAI's error object beside
them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from sglang.srt.entrypoints.http_guard import CLIENT_CLOSED
from sglang.srt.managers.request_validation import RequestError
from sglang.srt.managers.tokenizer_manager import BackendDeadError, ClientDisconnected, ServerAbortError
from sglang.srt.utils.error_body import anthropic_error_body, body_for_path, error_body, is_anthropic_path

logger = logging.getLogger(__name__)


def json_response(content: Any, status_code: int = 200) -> Response:
    if isinstance(content, BaseModel):
        content = content.model_dump()
    return Response(orjson.dumps(content), status_code=status_code, media_type="application/json")


def server_abort_body(e: ServerAbortError) -> dict:
    # Upstream answers these (deadlines) with the HTTP status as `code`, e.g. 503. One that names a
    # field of the request (a stop_regex out of time) is the client's error.
    if e.param is not None:
        return error_body(e.message, e.param, code=e.status_code, status=e.status_code)
    return error_body(e.message, kind="server_error", code=e.status_code, status=e.status_code)


def backend_dead_body(e: BackendDeadError) -> dict:
    return error_body(str(e), kind="server_error", code="backend_dead", status=503)


def internal_error_body(e: BaseException) -> dict:
    return error_body(f"Internal server error: {e}", kind="server_error", code="internal_error", status=500)


def internal_error_response(e: BaseException, path: str = "") -> Response:
    """A 500 for an error no handler maps (`ErrorMappingRoute` passes the mapped ones on), in the shape
    of the API `path` belongs to."""
    logger.exception("Request failed", exc_info=e)
    return json_response(body_for_path(path, f"Internal server error: {e}", "internal_error", "server_error", 500), 500)


def json_object(body: bytes) -> Any:
    """An optional JSON body ({} when empty); RequestError when it is not JSON."""
    try:
        return orjson.loads(body or b"{}")
    except orjson.JSONDecodeError as e:
        raise RequestError(f"The request body is not valid JSON: {e}.", None, "invalid_json") from None


def _shaped(request: Request, body: dict, status: int) -> Response:
    """`body` (OpenAI's shape), or its message in Anthropic's shape on Anthropic's paths."""
    if is_anthropic_path(request.url.path):
        body = anthropic_error_body(status, body["message"])
    return json_response(body, status)


async def _request_error(request: Request, e: RequestError) -> Response:
    return _shaped(request, error_body(e.message, e.param, e.code), 400)


async def _server_abort(request: Request, e: ServerAbortError) -> Response:
    return _shaped(request, server_abort_body(e), e.status_code)


async def _backend_dead(request: Request, e: BackendDeadError) -> Response:
    return _shaped(request, backend_dead_body(e), 503)


async def _control_timeout(request: Request, e: TimeoutError) -> Response:
    """A control call the scheduler did not answer in time (the generation path waits without one)."""
    return _shaped(request, error_body(str(e), kind="server_error", code="timeout", status=503), 503)


async def _client_closed(request: Request, e: ClientDisconnected) -> Response:
    return Response(status_code=CLIENT_CLOSED)


async def _http_exception(request: Request, e: HTTPException) -> Response:
    """Starlette's own (a path no route serves, a method a route does not take), in the same shape."""
    kind = "server_error" if e.status_code >= 500 else "invalid_request_error"
    message = f"{e.detail}." if not str(e.detail).endswith(".") else str(e.detail)
    body = body_for_path(request.url.path, message, None, kind, e.status_code)
    response = json_response(body, e.status_code)
    response.headers.update(e.headers or {})
    return response


Handler = Callable[[Request, Any], Coroutine[Any, Any, Response]]

HANDLERS: dict[type[Exception], Handler] = {
    RequestError: _request_error,
    ServerAbortError: _server_abort,
    BackendDeadError: _backend_dead,
    TimeoutError: _control_timeout,
    ClientDisconnected: _client_closed,
    HTTPException: _http_exception,
}

# Raised past a route to a handler: the project's errors and FastAPI's own.
_PASSED_ON = (*HANDLERS, RequestValidationError)


def install_error_handlers(app: FastAPI) -> None:
    for exc_class, handler in HANDLERS.items():
        app.add_exception_handler(exc_class, handler)


class ErrorMappingRoute(APIRoute):
    """A route whose unexpected errors are a 500 with an error body (the others go to the handlers)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def run(request: Request) -> Response:
            try:
                return await handler(request)
            except _PASSED_ON:
                raise
            except Exception as e:
                return internal_error_response(e, request.url.path)

        return run
