"""A request model's validation error as a RequestError naming the field (every OpenAI-shaped route's)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from sglang.srt.managers.request_validation import RequestError


class _FieldError(ValueError):
    def __init__(self, field: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.field = field
        self.code = code


def _field_error(field: str, message: str, code: str = "invalid_value") -> _FieldError:
    return _FieldError(field, message, code)


def request_error_from_validation(exc: ValidationError) -> RequestError:
    """The first validation error as a RequestError whose message names the field."""
    err = exc.errors(include_url=False)[0]
    kind = err.get("type", "")
    if kind == "json_invalid":
        return RequestError(
            f"The request body is not valid JSON: {err.get('ctx', {}).get('error', '')}.",
            None,
            "invalid_json",
        )
    loc = list(err.get("loc", ()))
    ctx_err = (err.get("ctx") or {}).get("error")
    if isinstance(ctx_err, _FieldError):
        return RequestError(f"{ctx_err.field}: {ctx_err}.", ctx_err.field, ctx_err.code)
    if not loc and kind in ("model_type", "model_attributes_type"):
        return RequestError("The request body must be a JSON object.", None, "invalid_type")
    param = _loc_to_param(loc)
    if kind == "missing":
        return RequestError(f"{param} is required.", param, "missing_required_parameter")
    msg = err.get("msg", "invalid value").removeprefix("Value error, ")
    code = "invalid_type" if kind.endswith("_type") or kind.endswith("_parsing") else "invalid_value"
    return RequestError(f"{param}: {msg}.", param, code)


def _loc_to_param(loc: list[Any]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif any(c in part for c in "[(-") or part in ("str", "int", "float", "bool"):
            continue  # pydantic's tag of a union branch (`list[str]`), not part of the field name
        else:
            out += f".{part}" if out else str(part)
    return out or "body"
