"""The body of every error reply: upstream SGLang's `ErrorResponse` fields at the top level, `code` being the
HTTP status, and OpenAI's error object beside them, whose `code` says what went wrong (the `openai` client
reads `body["error"]` when there is one):

    {"object": "error", "message": str, "type": str, "param": str | None, "code": int,
     "error": {"message": str, "type": str, "param": str | None, "code": str | int | None}}

`type` is OpenAI's: "invalid_request_error" for the client's errors, "server_error" for the server's. Here,
below the HTTP layer, so that the ASGI guards (API keys, body limits) answer in the same shape as the routes.
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
