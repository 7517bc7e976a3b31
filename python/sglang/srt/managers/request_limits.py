"""`RequestLimits`: what the server bounds a request by (its model's sizes and the flags), as the request
checks (`request_validation`, `request_sampling`, `logprob_limits`) read them. Its own module, below those
that read it, so that they import it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sglang.srt.managers.logprob_limits import (
    DEFAULT_MAX_HIDDEN_STATE_FLOATS,
    DEFAULT_MAX_LOGPROB_ENTRIES,
    DEFAULT_MAX_LOGPROBS,
)


@dataclass(frozen=True)
class RequestLimits:
    context_len: int
    max_req_input_len: int
    vocab_size: int
    # --enable-return-hidden-states (and no PD disaggregation: the prompt's states would stay on the
    # prefill server): None, or why a request cannot have them.
    hidden_states_refused: str | None = None
    routed_experts_enabled: bool = False  # --enable-return-routed-experts
    # --skip-tokenizer-init: the server holds no tokenizer, so whatever needs one is refused by name.
    without_tokenizer: bool = False
    custom_logit_processor_enabled: bool = False  # --enable-custom-logit-processor
    max_logprobs: int = DEFAULT_MAX_LOGPROBS  # --max-logprobs (`logprob_limits`)
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES  # --max-logprob-entries-per-request
    hidden_size: int = 0  # the floats of one position's hidden state (return_hidden_states)
    max_hidden_state_floats: int = DEFAULT_MAX_HIDDEN_STATE_FLOATS  # --max-hidden-state-floats-per-request
    # --preferred-sampling-params: sampling_params for the fields a request leaves unset (`request_sampling`).
    preferred_sampling_params: dict[str, Any] | None = None
    auto_truncate: bool = False  # --allow-auto-truncate: a prompt over the limit is cut, not refused
    reasoning_parser: bool = False  # --reasoning-parser (and a tokenizer): require_reasoning is served
    strict_thinking: bool = False  # --enable-strict-thinking: max_thinking_tokens is served
    # The adapters a request may name (`lora/lora_registry.LoRARegistry`); None: a test's limits, no LoRA.
    lora: Any = None
