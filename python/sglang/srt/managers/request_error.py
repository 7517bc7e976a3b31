"""`RequestError`: what a request a client got wrong raises, anywhere it is checked."""

from __future__ import annotations


class RequestError(ValueError):
    """A request a client got wrong: becomes HTTP 400 with `param` naming the field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
