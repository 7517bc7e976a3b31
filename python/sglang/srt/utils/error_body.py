"""The body of every error reply: upstream SGLang's `ErrorResponse` fields at the top level, `code` being the
HTTP status, and OpenAI's error object beside them, whose `code` says what went wrong (the `openai` client
reads `body["error"]` when there is one):

    {"object": "error", "message": str, "type": str, "param": str | None, "code": int,
     "error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

`type` is OpenAI's: "invalid_request_error" for the client's errors, "server_error" for the server's. Here,
below the HTTP layer, so that the ASGI guards (API keys, body limits) answer in the same shape as the routes.

Anthropic's routes (/v1/messages...) answer in Anthropic's shape instead, wherever the error comes from:
`{"type": "error", "error": {"type": str, "message": str}}` (`body_for_path`).
"""

from __future__ import annotations

from typing import Any


def error_body(
    message: str,
    param: str | None = None,
    code: Any = None,
    kind: str = "invalid_request_error",
    status: int = 400,
) -> dict:
    """An error reply's body: `status` is the HTTP status it goes with, `code` OpenAI's."""
    return {
        "object": "error",
        "message": message,
        "type": kind,
        "param": param,
        "code": status,
        "error": {"message": message, "type": kind, "param": param, "code": code},
    }


ANTHROPIC_PATHS = ("/v1/messages",)
# Anthropic's error types by HTTP status.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
}  # fmt: skip


def anthropic_error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATHS[0] or path.startswith(ANTHROPIC_PATHS[0] + "/")


def body_for_path(path: str, message: str, code: Any, kind: str, status: int, param: str | None = None) -> dict:
    """An error body in the shape of the API `path` belongs to."""
    if is_anthropic_path(path):
        return anthropic_error_body(status, message)
    return error_body(message, param, code, kind, status)
