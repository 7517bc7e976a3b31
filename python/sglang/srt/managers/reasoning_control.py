"""A request's reasoning control (upstream's `require_reasoning` and `max_thinking_tokens`), checked where
the request comes in; the scheduler enforces it (`constrained/reasoning_grammar.py`)."""

from __future__ import annotations

from typing import Any

from sglang.srt.managers.request_error import RequestError

MAX_THINKING_TOKENS = 1 << 31  # (any budget past a context length means none; this only bounds the type)


def check_reasoning(require: Any, budget: Any, limits: Any) -> tuple[bool, int | None]:
    """(require_reasoning, max_thinking_tokens) of one prompt, or a RequestError naming the field."""
    if not isinstance(require, bool):
        raise RequestError("require_reasoning must be a boolean.", "require_reasoning", "invalid_type")
    if require and not limits.reasoning_parser:
        message = "require_reasoning needs the server started with --reasoning-parser (the think markers)."
        raise RequestError(message, "require_reasoning")
    if budget is None:
        return require, None
    if isinstance(budget, bool) or not isinstance(budget, int) or not 0 <= budget < MAX_THINKING_TOKENS:
        message = "max_thinking_tokens must be an integer >= 0, or null."
        raise RequestError(message, "max_thinking_tokens", "invalid_type")
    if not require:
        message = "max_thinking_tokens budgets a request's reasoning: send require_reasoning: true with it."
        raise RequestError(message, "max_thinking_tokens")
    if not limits.strict_thinking:
        # Upstream's words.
        message = "max_thinking_tokens requires the server to be launched with --enable-strict-thinking"
        raise RequestError(message + ".", "max_thinking_tokens")
    return require, budget


def with_thinking_budget(custom_params: dict[str, Any] | None, budget: int | None) -> dict[str, Any] | None:
    """The sampling params' `custom_params` with `thinking_budget` set to `budget` (upstream carries the
    budget there; it replaces one the client put there), or as they were."""
    if budget is None:
        return custom_params
    return {**(custom_params or {}), "thinking_budget": budget}
