"""A generate request's `sampling_params`, parsed and checked, for each of its prompts.

A batch sends one object for all its prompts, or one per prompt. Each distinct object is parsed and
checked once (`PromptSamplingParams`), then fitted to each prompt's length (the default and the room
for `max_new_tokens`): a 107 KB json_schema shared by 4,096 prompts was checked 4,096 times, 225 s of
the HTTP event loop, and is checked once now; what a batch costs grows with its prompts and the bytes
of its body only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang.srt.managers.request_error import RequestError
from sglang.srt.sampling.sampling_params import SamplingParams, SamplingParamsError

if TYPE_CHECKING:
    from sglang.srt.managers.request_limits import RequestLimits

# Without an explicit max_new_tokens (or one from --preferred-sampling-params), a request generates at
# most this many tokens (SGLang's default: SamplingParams'), fewer if the context ends first.
DEFAULT_MAX_NEW_TOKENS = 128
assert SamplingParams.from_dict({}).max_new_tokens == DEFAULT_MAX_NEW_TOKENS


def parse_sampling_params(
    d: Any, limits: RequestLimits, param_prefix: str = "sampling_params."
) -> tuple[SamplingParams, bool]:
    """`d` checked (RequestError naming the field), and whether it gives max_new_tokens."""
    if d is not None and not isinstance(d, dict):
        raise RequestError("sampling_params must be an object.", "sampling_params", "invalid_type")
    # Clients (SGLang's own included) send null for "unset".
    d = {k: v for k, v in (d or {}).items() if v is not None}
    explicit_max = "max_new_tokens" in d  # (one from --preferred-sampling-params is a default: cut to fit)
    if limits.preferred_sampling_params:
        d = with_preferred(d, limits.preferred_sampling_params)
    try:
        params = SamplingParams.from_dict(d)
        params.verify(limits.vocab_size)
    except SamplingParamsError as e:
        raise RequestError(str(e), param_prefix + _param_of(str(e))) from None
    except TypeError as e:  # e.g. a list where a number belongs, caught by the dataclass constructor
        raise RequestError(f"Invalid sampling_params: {e}.", "sampling_params", "invalid_type") from None
    return params, explicit_max


# A request that names one of these has its own grammar: the preferred one is left out, not combined.
GRAMMAR_KEYS = ("json_schema", "regex", "ebnf", "structural_tag")


def with_preferred(d: dict[str, Any], preferred: dict[str, Any]) -> dict[str, Any]:
    """A request's sampling_params over --preferred-sampling-params (checked at start: no `n`): the
    request's own fields win, its own grammar replaces a preferred one, and a preferred min_new_tokens is
    cut to the max_new_tokens in force (a default never makes a request invalid)."""
    if any(k in d for k in GRAMMAR_KEYS):
        preferred = {k: v for k, v in preferred.items() if k not in GRAMMAR_KEYS}
    merged = {**preferred, **d}
    if "min_new_tokens" in preferred and "min_new_tokens" not in d:
        merged["min_new_tokens"] = min(preferred["min_new_tokens"], merged.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
    return merged


def fit_to_prompt(
    params: SamplingParams,
    explicit_max: bool,
    input_len: int,
    limits: RequestLimits,
    param_prefix: str = "sampling_params.",
) -> tuple[int, int]:
    """(max_new_tokens, min_new_tokens) for a prompt of `input_len` tokens: an explicit max_new_tokens
    must fit the context (RequestError), the default is cut to it."""
    room = limits.context_len - input_len
    if explicit_max and params.max_new_tokens > room and limits.auto_truncate:
        # --allow-auto-truncate: as upstream, lowered to what fits (a prompt cut to the limit leaves
        # room for one token or a few; a client that always sends max_tokens would get 400 else).
        return room, min(params.min_new_tokens, room)
    if explicit_max and params.max_new_tokens > room:
        raise RequestError(
            f"max_new_tokens {params.max_new_tokens} plus the {input_len} input tokens exceeds the "
            f"model's context length of {limits.context_len} tokens (at most {room} new tokens fit).",
            param_prefix + "max_new_tokens",
            "context_length_exceeded",
        )
    if explicit_max:
        return params.max_new_tokens, params.min_new_tokens
    max_new = min(params.max_new_tokens, room)  # (DEFAULT_MAX_NEW_TOKENS, or --preferred-sampling-params')
    return max_new, min(params.min_new_tokens, max_new)


class PromptSamplingParams:
    """The sampling_params of one request's prompts: each distinct object parsed once."""

    def __init__(self, limits: RequestLimits):
        self.limits = limits
        # By identity: the objects stay alive in the request while this lives.
        self._parsed: dict[int, tuple[SamplingParams, bool]] = {}

    def for_prompt(self, d: Any, input_len: int) -> tuple[SamplingParams, int, int]:
        """The parsed `d` (shared: copy it before changing it) and the prompt's (max_new_tokens,
        min_new_tokens)."""
        parsed = self._parsed.get(id(d))
        if parsed is None:
            parsed = self._parsed[id(d)] = parse_sampling_params(d, self.limits)
        params, explicit_max = parsed
        return params, *fit_to_prompt(params, explicit_max, input_len, self.limits)


def _param_of(message: str) -> str:
    """SamplingParamsError messages start with the field name (see sampling_params.verify)."""
    first = message.split()[0] if message else ""
    return first.removeprefix("sampling_params.").rstrip(".,:")
