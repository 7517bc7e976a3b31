"""`SamplingParams`: SGLang's sampling fields, with validation that names the field."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from sglang.srt.constrained.grammar_spec import check_grammar_fields
from sglang.srt.constrained.stop_regex import check_stop_regex
from sglang.srt.constrained.stop_strings import check_stops

MAX_N = 64
# A temperature below this samples greedily, as upstream (`_SAMPLING_EPS`): dividing logits by it would
# overflow float32.
SAMPLING_EPS = 1e-6
FLOAT32_MAX = 3.4028234663852886e38
# A top_k at least this large (or the vocabulary's size, where known) keeps every token: it is -1.
TOP_K_ALL = 1 << 30


class SamplingParamsError(ValueError):
    """Bad sampling input; the message names the field (HTTP 400)."""


@dataclass(slots=True)
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop: list[str] = field(default_factory=list)
    # Regular expressions searched in the tail of the output; a match stops the request with the
    # pattern as `matched` (upstream reports the pattern, and keeps the matched text in the output).
    stop_regex: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # Keep a matched stop string (or the text of a matched stop token) in the output text, as upstream.
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    n: int = 1
    sampling_seed: int | None = None
    # Logit penalties (`penaltylib.py` has the rules): frequency and presence in [-2, 2], repetition in
    # (0, 2]; logit_bias maps token ids (JSON keys are strings) to a bias added to their logits.
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # Constrained decoding (`sglang/srt/constrained/`): at most one, each a string (a JSON schema as text).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # The request's settings for its custom logit processor (`custom_logit_processor.py`), as upstream.
    custom_params: dict[str, Any] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        if "seed" in d and "sampling_seed" not in d:
            d["sampling_seed"] = d.pop("seed")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise SamplingParamsError(f"sampling_params.{unknown[0]} is not a supported sampling parameter.")
        for name in ("stop", "stop_regex"):
            if isinstance(d.get(name), str):
                d[name] = [d[name]]
            if d.get(name) is None:
                d[name] = []
        if d.get("stop_token_ids") is None:
            d["stop_token_ids"] = []
        params = cls(**d)
        params.verify()
        return params

    def verify(self, vocab_size: int | None = None) -> None:
        """Raise SamplingParamsError naming the first bad field."""
        _int("max_new_tokens", self.max_new_tokens, low=0)
        _int("min_new_tokens", self.min_new_tokens, low=0)
        if self.min_new_tokens > self.max_new_tokens:
            raise SamplingParamsError("min_new_tokens must not exceed max_new_tokens.")
        _num("temperature", self.temperature)
        if self.temperature < 0:
            raise SamplingParamsError(f"temperature must be non-negative, got {self.temperature}.")
        # Beyond float32's range it would be inf in the batch's tensor, and a banned (-inf) logit over
        # inf is NaN: the largest float32 samples the same (every finite logit over it is ~0).
        self.temperature = min(self.temperature, FLOAT32_MAX)
        _num("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}.")
        _int("top_k", self.top_k, low=-1)
        if self.top_k == 0:
            raise SamplingParamsError("top_k must be -1 (disabled) or a positive integer, got 0.")
        if self.top_k >= (vocab_size or TOP_K_ALL):
            # Keeps every token, as -1 does (and an int beyond int64 could not go into the batch's tensor).
            self.top_k = -1
        _num("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise SamplingParamsError(f"min_p must be in [0, 1], got {self.min_p}.")
        _int("n", self.n, low=1)
        if self.n > MAX_N:
            raise SamplingParamsError(f"n must be at most {MAX_N}, got {self.n}.")
        if self.sampling_seed is not None:
            _int("seed", self.sampling_seed, low=0)
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            _num(name, value)
            if not -2 <= value <= 2:
                raise SamplingParamsError(f"{name} must be in [-2, 2], got {value}.")
        _num("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= 2:
            raise SamplingParamsError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        self.logit_bias = _logit_bias(self.logit_bias, vocab_size)
        if self.custom_params is not None and not isinstance(self.custom_params, dict):
            message = "custom_params must be an object (the custom logit processor's settings)."
            raise SamplingParamsError(message)
        for name in ("ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(f"{name} must be a boolean.")
        check_stops(self.stop, SamplingParamsError)  # its bounds (constrained/stop_strings.py)
        check_stop_regex(self.stop_regex, SamplingParamsError)  # its bounds, and that `regex` compiles it
        check_grammar_fields(self, SamplingParamsError)
        if not isinstance(self.stop_token_ids, list):
            raise SamplingParamsError("stop_token_ids must be a list of token ids.")
        for t in self.stop_token_ids:
            _int("stop_token_ids", t, low=0)
        if vocab_size is not None:
            # An id beyond the vocabulary is never sampled, so it never stops anything: accepted, as
            # upstream (its JSON-constrained kit sends one), and dropped here, so that no vocabulary-sized
            # tensor downstream (min_new_tokens' ban of the stop ids) is indexed with it.
            self.stop_token_ids = [t for t in self.stop_token_ids if t < vocab_size]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


def _logit_bias(bias: Any, vocab_size: int | None) -> dict[int, float] | None:
    """`logit_bias` with int keys (None when empty); its ids in the vocabulary, its biases in [-100, 100]
    (OpenAI's range: a larger one turns the logits to inf and the logprobs to NaN)."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise SamplingParamsError("logit_bias must be an object mapping token ids to biases.")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = key
        if isinstance(key, str):
            try:
                token = int(key)
            except ValueError:
                raise SamplingParamsError(f"logit_bias keys must be token ids, got {key!r}.") from None
        _int("logit_bias token id", token, low=0)
        if vocab_size is not None and token >= vocab_size:
            raise SamplingParamsError(
                f"logit_bias names token {token}, outside the vocabulary of {vocab_size}."
            )
        _num("logit_bias", value)
        if not -100 <= value <= 100:
            raise SamplingParamsError(f"logit_bias values must be in [-100, 100], got {value}.")
        out[token] = float(value)
    return out or None


def _int(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(f"{name} must be an integer, got {value!r}.")
    if value < low:
        raise SamplingParamsError(f"{name} must be at least {low}, got {value}.")


def _num(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingParamsError(f"{name} must be a number, got {value!r}.")
    if value != value or value in (float("inf"), float("-inf")):
        raise SamplingParamsError(f"{name} must be a finite number, got {value!r}.")
