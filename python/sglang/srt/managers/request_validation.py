"""Validation and normalisation of generate requests, before anything reaches the scheduler.

A native request (`GenerateReqInput`, one prompt or a batch, each possibly with `n > 1` samples) becomes
a flat list of `TokenizedGenerateReqInput`, one per sample, or raises `RequestError` naming the field.
A whole batch is checked before any of it is sent, so a bad item never leaves its siblings running.

Three steps, so that the caller can tokenize in between without blocking (`TokenizerManager`):
`parse_prompts` (the shape of the input, and the fan-out cap), tokenizing `Prompts.texts`, then
`build_requests`. `normalize_generate_request` runs the three in a row.
"""

from __future__ import annotations

import hashlib
import logging
import uuid
from dataclasses import dataclass, replace
from typing import Any

from sglang.srt.constrained.grammar_spec import grammar_key
from sglang.srt.managers.io_struct import BootstrapInfo, GenerateReqInput, TokenizedGenerateReqInput
from sglang.srt.managers.logprob_limits import (
    check_hidden_state_floats,
    check_logprob_entries,
    check_logprobs_per_position,
)
from sglang.srt.managers.reasoning_control import check_reasoning, with_thinking_budget
from sglang.srt.managers.request_error import RequestError
from sglang.srt.managers.request_limits import RequestLimits
from sglang.srt.managers.request_sampling import PromptSamplingParams
from sglang.srt.managers.text_encoder import Encoded, encode_texts
from sglang.srt.sampling.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# --max-samples-per-request's default (the max running requests when more): measured on a loaded 2-core
# host, the HTTP process checks, sends and answers a batch at ~0.1 ms per sample, so a request at the bound
# holds its event loop up to ~0.65 s (docs/server.md, "Limits"); upstream's own batches (its radix-cache kit's 401 prompts, the offline
# throughput bench's 1,000) fit.
DEFAULT_MAX_SAMPLES = 4096


# Upstream's words for a text prompt sent to a server without a tokenizer.
TEXT_WITHOUT_TOKENIZER = (
    "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please provide "
    "input_ids or re-initialize the engine with skip_tokenizer_init=False."
)


def check_tokenizer_free(params: SamplingParams, return_text_in_logprobs: bool) -> None:
    """Under --skip-tokenizer-init, refuse (naming the field) what needs the tokenizer: stop strings and
    regexes are searched in the output's text, a grammar's tokens are matched by their text, and
    return_text_in_logprobs decodes ids. Stop token ids, min_new_tokens and the rest still work (the
    end-of-sequence ids come from the model's configs)."""
    fields = [name for name in ("stop", "stop_regex") if getattr(params, name)]
    grammar = grammar_key(params)
    fields += [grammar[0]] if grammar is not None else []
    if fields:
        name = fields[0]
        raise RequestError(
            f"{name} is unavailable when skip_tokenizer_init=True: the server holds no tokenizer to "
            "match it against the output's text (stop on token ids with stop_token_ids).",
            "sampling_params." + name,
        )
    if return_text_in_logprobs:
        raise RequestError(
            "return_text_in_logprobs is unavailable when skip_tokenizer_init=True: the server holds no "
            "tokenizer to decode the token ids.",
            "return_text_in_logprobs",
        )


@dataclass
class Prompts:
    """The prompts of a request: `texts` to tokenize (empty with input_ids), `ids` per prompt (None
    for a text prompt), and whether the request was a batch."""

    texts: list[str]
    ids: list[Any]
    is_batch: bool

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class NormalizedRequest:
    """One sample to send: the tokenized request, and where its output goes in the reply."""

    req: TokenizedGenerateReqInput
    index: int
    return_text_in_logprobs: bool
    prompt: int = 0  # which prompt of the call it samples (its images are that prompt's)
    return_prompt_token_ids: bool = False  # its replies carry "prompt_token_ids" (upstream's)
    session: Any = None  # with session_params: its `session_controller.SessionPlan`


def hidden_states_refused(server_args: Any) -> str | None:
    """Why this server refuses return_hidden_states, or None (upstream's flag)."""
    if not server_args.enable_return_hidden_states:
        return "return_hidden_states needs the server started with --enable-return-hidden-states."
    if server_args.disaggregation_mode != "null":
        return (
            "return_hidden_states is not supported with --disaggregation-mode (the prompt's hidden states "
            "would stay on the prefill server)."
        )
    return None


def check_custom_logit_processor(value: Any, limits: RequestLimits) -> str | None:
    """A request's `custom_logit_processor` (the scheduler loads it: its code runs there only)."""
    if value is None or value == "":
        return None
    if not limits.custom_logit_processor_enabled:
        # Upstream's words.
        message = "The server is not configured to enable custom logit processor."
        message += " Start it with --enable-custom-logit-processor."
        raise RequestError(message, "custom_logit_processor")
    if not isinstance(value, str):
        message = "custom_logit_processor must be the string CustomLogitProcessor.to_str() makes."
        raise RequestError(message, "custom_logit_processor", "invalid_type")
    return value


def auto_truncated(ids: list[int], limits: RequestLimits, param: str, total: int | None = None) -> list[int]:
    """--allow-auto-truncate: a prompt over the limit keeps its first `max_req_input_len` tokens (upstream's
    rule: the end is dropped), said in the log (`total`: its whole length, where `ids` are a cut already)."""
    if len(ids) <= limits.max_req_input_len:
        return ids
    logger.warning("The input %s (%s tokens) is cut to its first %d tokens (--allow-auto-truncate).",
                   param, total or len(ids), limits.max_req_input_len)  # fmt: skip
    return ids[: limits.max_req_input_len]


def check_input_ids(ids: Any, limits: RequestLimits, param: str, truncate: bool = False) -> list[int]:
    if not isinstance(ids, list):
        raise RequestError(f"{param} must be a list of token ids.", param, "invalid_type")
    if truncate:
        ids = auto_truncated(ids, limits, param)
    # The length first: a huge list is refused without a scan of every element.
    check_input_len(len(ids), limits, param)
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int):
            raise RequestError(f"{param}[{i}] must be an integer token id, got {t!r}.", param, "invalid_type")
        if not 0 <= t < limits.vocab_size:
            raise RequestError(
                f"{param}[{i}] = {t} is outside the vocabulary (valid ids are 0..{limits.vocab_size - 1}).",
                param,
            )
    return ids


def check_input_len(n: int, limits: RequestLimits, param: str, at_least: bool = False) -> None:
    if n == 0:
        raise RequestError(f"The prompt ({param}) is empty; send at least one token.", param)
    size = f"more than {n} tokens" if at_least else f"{n} tokens"
    if n >= limits.context_len:
        raise RequestError(
            f"The input {param} ({size}) is longer than the model's context length ({limits.context_len} tokens).",
            param,
            "context_length_exceeded",
        )
    if n > limits.max_req_input_len:
        raise RequestError(
            f"The input {param} ({size}) is longer than the server accepts ({limits.max_req_input_len} tokens).",
            param,
            "context_length_exceeded",
        )


def check_logprob_args(
    return_logprob: Any, logprob_start_len: Any, top_logprobs_num: Any, input_len: int
) -> None:
    if not isinstance(return_logprob, bool):
        raise RequestError("return_logprob must be a boolean.", "return_logprob", "invalid_type")
    if isinstance(logprob_start_len, bool) or not isinstance(logprob_start_len, int):
        raise RequestError("logprob_start_len must be an integer.", "logprob_start_len", "invalid_type")
    if not -1 <= logprob_start_len < input_len:
        raise RequestError(
            f"logprob_start_len must be -1 (no input logprobs) or a position in the input "
            f"(0..{input_len - 1}), got {logprob_start_len}.",
            "logprob_start_len",
        )
    if isinstance(top_logprobs_num, bool) or not isinstance(top_logprobs_num, int):
        raise RequestError("top_logprobs_num must be an integer.", "top_logprobs_num", "invalid_type")
    if top_logprobs_num < 0:
        raise RequestError(f"top_logprobs_num must be 0 or more, got {top_logprobs_num}.", "top_logprobs_num")


def parse_prompts(obj: GenerateReqInput, max_samples: int | None = None) -> Prompts:
    """The shape of `obj`'s input, checked; and the number of sequences it would start, capped."""
    if (obj.text is None) == (obj.input_ids is None):
        raise RequestError("Give exactly one of text and input_ids.", "text", "missing_required_parameter")
    if obj.text is not None:
        is_batch = isinstance(obj.text, list)
        texts = obj.text if is_batch else [obj.text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise RequestError(
                "text must be a string or a non-empty list of strings.", "text", "invalid_type"
            )
        prompts = Prompts(list(texts), [None] * len(texts), is_batch)
    else:
        ids = obj.input_ids
        if not isinstance(ids, list):
            raise RequestError(
                "input_ids must be a list of token ids (or of lists).", "input_ids", "invalid_type"
            )
        is_batch = bool(ids) and all(isinstance(x, list) for x in ids)
        prompts = Prompts([], ids if is_batch else [ids], is_batch)
    if max_samples is not None:
        field = "text" if obj.text is not None else "input_ids"
        check_fanout(obj.sampling_params, len(prompts), max_samples, field)
    return prompts


def max_samples_per_request(configured: int | None, max_running_requests: int) -> int:
    """--max-samples-per-request, else DEFAULT_MAX_SAMPLES or, on a server that runs more at once, a full
    batch of running requests."""
    return configured or max(DEFAULT_MAX_SAMPLES, max_running_requests)


def check_fanout(sampling_params: Any, num_prompts: int, max_samples: int, field: str = "input_ids") -> None:
    """One request may start at most `max_samples` sequences (prompts times n): what checking, sending
    and answering it costs the HTTP process grows with them. Counted before anything is tokenized; n's
    own cap (MAX_N) is checked with the other sampling params."""
    per_item = sampling_params if isinstance(sampling_params, list) else [sampling_params] * num_prompts
    ns = [_raw_n(p) for p in per_item[:num_prompts]]
    total = sum(ns) + max(0, num_prompts - len(ns))
    if total <= max_samples:
        return
    n = max(ns, default=1)
    if n == 1:
        shape, param, fix = f"{num_prompts} prompts in {field}", field, "send the prompts in several requests"
    else:
        shape = f"{num_prompts} prompts with n = {n}" if num_prompts > 1 else f"n = {n}"
        param, fix = "sampling_params.n", "ask for fewer samples or send fewer prompts per request"
    raise RequestError(
        f"This request would start {total} sequences ({shape}); the server starts at most {max_samples} "
        f"per request (--max-samples-per-request): {fix}.",
        param,
    )


def _raw_n(params: Any) -> int:
    n = params.get("n") if isinstance(params, dict) else None
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1


BOOTSTRAP_FIELDS = ("bootstrap_host", "bootstrap_port", "bootstrap_room")
# A value each, or a list of one per prompt.
PER_ITEM_FIELDS = (
    "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_hidden_states", "custom_logit_processor", "priority", "lora_path", "return_routed_experts",
    "require_reasoning", "max_thinking_tokens",
)  # fmt: skip


def bootstrap_info(host: Any, port: Any, room: Any) -> BootstrapInfo | None:
    """The PD fields of one prompt: none, or a room with the prefill server's host (and port)."""
    if room is None:
        return None
    if not isinstance(room, int) or isinstance(room, bool) or room < 0:
        raise RequestError("bootstrap_room must be a non-negative integer.", "bootstrap_room", "invalid_type")
    if not isinstance(host, str) or not host:
        raise RequestError(
            "bootstrap_host must be set with bootstrap_room.", "bootstrap_host", "invalid_type"
        )
    if port is not None and (not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536):
        raise RequestError("bootstrap_port must be a port number or null.", "bootstrap_port", "invalid_type")
    return BootstrapInfo(host, port, str(room))


def sample_bootstrap(info: BootstrapInfo | None, j: int, n: int) -> BootstrapInfo | None:
    """Sample j of n gets its own room (both servers fan out the same way, so the rooms pair up)."""
    return info if info is None or n == 1 else replace(info, room=f"{info.room}#{j}")


def build_requests(
    obj: GenerateReqInput, prompts: Prompts, encoded: list[Encoded], limits: RequestLimits
) -> tuple[list[NormalizedRequest], bool]:
    """Check everything else and expand `prompts` (with `encoded[i]`, the tokens of `prompts.texts[i]`)
    into one request per sample; returns them and whether the reply is a list."""
    size = len(prompts)
    if size > 1 and obj.bootstrap_room is not None and not isinstance(obj.bootstrap_room, list):
        # One room pairs one request's halves; a shared one would pair the wrong ones.
        raise RequestError(
            "bootstrap_room must be a list with one room per prompt in a batch.", "bootstrap_room"
        )
    per_item = {
        name: _per_item(getattr(obj, name), size, name, prompts.is_batch)
        for name in PER_ITEM_FIELDS + BOOTSTRAP_FIELDS + NAMESPACE_FIELDS
    }
    token_ids_lists = _token_ids_logprob(obj.token_ids_logprob, size, prompts.is_batch, limits)
    for name in ("return_text_in_logprobs", "return_prompt_token_ids"):
        if not isinstance(getattr(obj, name), bool):
            raise RequestError(f"{name} must be a boolean.", name, "invalid_type")
    if not isinstance(obj.stream, bool):
        raise RequestError("stream must be a boolean.", "stream", "invalid_type")

    out: list[NormalizedRequest] = []
    texts = iter(zip(prompts.texts, encoded, strict=True))
    # A value sent once for all prompts is checked once (the sampling params' grammar, the salt's digest).
    sampling = PromptSamplingParams(limits)
    namespaces: dict[tuple[int, int], str | None] = {}
    truncate = limits.auto_truncate and obj.image_data is None and obj.video_data is None  # (media: no cut)
    for i, ids in enumerate(prompts.ids):
        text = None
        if ids is None:
            text, enc = next(texts)
            if truncate and enc.ids is not None:
                ids = auto_truncated(enc.ids, limits, "text", enc.num_tokens)
                check_input_len(len(ids), limits, "text")
            else:
                check_input_len(enc.num_tokens, limits, "text", enc.at_least)
                ids = enc.ids
        else:
            ids = check_input_ids(ids, limits, "input_ids", truncate)
        params, max_new, min_new = sampling.for_prompt(per_item["sampling_params"][i], len(ids))
        if limits.without_tokenizer:
            check_tokenizer_free(params, obj.return_text_in_logprobs)
        start = per_item["logprob_start_len"][i]
        top = per_item["top_logprobs_num"][i]
        check_logprob_args(per_item["return_logprob"][i], start, top, len(ids))
        check_logprobs_per_position(top, limits.max_logprobs, limits.vocab_size, "top_logprobs_num")
        token_ids = token_ids_lists[i]
        hidden = per_item["return_hidden_states"][i]
        if not isinstance(hidden, bool):
            message = "return_hidden_states must be a boolean."
            raise RequestError(message, "return_hidden_states", "invalid_type")
        if hidden and limits.hidden_states_refused is not None:
            raise RequestError(limits.hidden_states_refused, "return_hidden_states")
        routing = per_item["return_routed_experts"][i]
        if not isinstance(routing, bool):
            raise RequestError("return_routed_experts must be a boolean.", "return_routed_experts", "invalid_type")
        if routing and not limits.routed_experts_enabled:
            message = "return_routed_experts needs the server started with --enable-return-routed-experts."
            raise RequestError(message, "return_routed_experts")
        processor = check_custom_logit_processor(per_item["custom_logit_processor"][i], limits)
        reasoning, budget = check_reasoning(per_item["require_reasoning"][i], per_item["max_thinking_tokens"][i], limits)
        priority = per_item["priority"][i]
        if priority is not None and (
            isinstance(priority, bool) or not isinstance(priority, int) or abs(priority) >= 1 << 62
        ):
            raise RequestError("priority must be an integer within +-2**62, or null.", "priority", "invalid_type")
        rid = per_item["rid"][i]
        if rid is not None and (not isinstance(rid, str) or not rid):
            raise RequestError("rid must be a non-empty string.", "rid", "invalid_type")
        base = rid or uuid.uuid4().hex
        n = params.n
        bootstrap = bootstrap_info(*(per_item[name][i] for name in BOOTSTRAP_FIELDS))
        lora_id = resolve_lora(per_item["lora_path"][i], limits)
        salt_and_key = [per_item[name][i] for name in NAMESPACE_FIELDS]
        key = (id(salt_and_key[0]), id(salt_and_key[1]), lora_id)
        if key not in namespaces:
            namespaces[key] = cache_namespace(*salt_and_key, lora_id=lora_id)
        extra_key = namespaces[key]
        for j in range(n):
            # Each sample is its own request; seeded samples get distinct seeds, else n copies of one
            # seeded request would all return the same text.
            seed = params.sampling_seed + j if params.sampling_seed is not None else None
            sample_params = replace(
                params, n=1, sampling_seed=seed, max_new_tokens=max_new, min_new_tokens=min_new,
                stop=list(params.stop), stop_regex=list(params.stop_regex),
                custom_params=with_thinking_budget(params.custom_params, budget),
            )  # fmt: skip
            req = TokenizedGenerateReqInput(
                rid=base if n == 1 else f"{base}-{j}",
                input_text=text,
                input_ids=list(ids),
                sampling_params=sample_params,
                return_logprob=per_item["return_logprob"][i],
                logprob_start_len=start,
                top_logprobs_num=top,
                token_ids_logprob=None if token_ids is None else list(token_ids),
                stream=obj.stream,
                bootstrap=sample_bootstrap(bootstrap, j, n),
                extra_key=extra_key,
                return_hidden_states=hidden,
                return_routed_experts=routing,
                custom_logit_processor=processor,
                priority=priority,
                lora_id=lora_id,
                require_reasoning=reasoning,
            )
            out.append(NormalizedRequest(req, len(out), obj.return_text_in_logprobs, i, obj.return_prompt_token_ids))
    rids = [r.req.rid for r in out]
    if len(set(rids)) != len(rids):
        raise RequestError("rid values must be unique within a request.", "rid")
    reqs = [r.req for r in out]
    check_logprob_entries(reqs, limits.max_logprob_entries)
    check_hidden_state_floats(reqs, limits.hidden_size, limits.max_hidden_state_floats)
    return out, prompts.is_batch or len(out) > 1


def normalize_generate_request(
    obj: GenerateReqInput, tokenizer: Any, limits: RequestLimits, max_samples: int | None = None
) -> tuple[list[NormalizedRequest], bool]:
    """Check and tokenize `obj` on this thread, as `TokenizerManager.normalize` does off it; returns its
    samples and whether the reply is a list."""
    prompts = parse_prompts(obj, max_samples)
    encoded = encode_texts(tokenizer, prompts.texts, limits.context_len)
    return build_requests(obj, prompts, encoded, limits)


def _token_ids_logprob(
    value: Any, size: int, is_batch: bool, limits: RequestLimits
) -> list[list[int] | None]:
    """`token_ids_logprob` per prompt: one list of token ids for all, or (a batch) one list (or null)
    per prompt, as upstream; each id in the vocabulary, at most --max-logprobs of them."""
    name = "token_ids_logprob"
    vocab_size = limits.vocab_size
    if value is None:
        return [None] * size
    if not isinstance(value, list) or not value:
        raise RequestError(f"{name} must be a non-empty list of token ids.", name, "invalid_type")
    if is_batch and all(v is None or isinstance(v, list) for v in value):
        if len(value) != size:
            raise RequestError(f"{name} has {len(value)} lists for a batch of {size} prompts.", name)
        lists = value
    else:
        lists = [value] * size
    for ids in {id(x): x for x in lists}.values():  # (one list for all prompts is checked once)
        if ids is None:
            continue
        if not isinstance(ids, list) or not ids:
            raise RequestError(f"{name} must hold non-empty lists of token ids.", name, "invalid_type")
        # As top_logprobs_num: its cost grows with positions x ids.
        check_logprobs_per_position(len(ids), limits.max_logprobs, vocab_size, name)
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int):
                raise RequestError(f"{name} must hold integer token ids, got {t!r}.", name, "invalid_type")
            if not 0 <= t < vocab_size:
                raise RequestError(f"{name} names {t}, outside the vocabulary of {vocab_size}.", name)
    return lists


NAMESPACE_FIELDS = ("cache_salt", "extra_key")  # in upstream's order of concatenation


def resolve_lora(name: Any, limits: RequestLimits) -> str | None:
    """The id of the LoRA adapter a prompt names in lora_path (None: the base model; "" too, as clients
    send it for unset)."""
    if name is None or name == "":
        return None
    if limits.lora is None:
        raise RequestError(f"lora_path names LoRA adapter {name!r}, but LoRA is not enabled.", "lora_path")
    return limits.lora.resolve(name)


def cache_namespace(cache_salt: Any, extra_key: Any, lora_id: str | None = None) -> str | None:
    """A request's prefix-cache namespace: upstream's `cache_salt + extra_key` (each a string; empty or
    null leaves it out), and its LoRA adapter's id (as upstream appends it: an adapter's prefixes are
    its own), as a 128-bit digest (32 hex digits), so a long salt costs the tree and the n-gram table
    no more than a short one; None: the namespace of requests that name none."""
    parts = []
    for name, value in zip(NAMESPACE_FIELDS, (cache_salt, extra_key), strict=True):
        if value is None or value == "":
            continue
        if not isinstance(value, str):
            raise RequestError(f"{name} must be a string.", name, "invalid_type")
        parts.append(value)
    text = "".join(parts).encode("utf-8", "surrogatepass")
    if lora_id is not None:
        # A digest of its own kind (`person`), of the salt's length, the salt and the id: no salt, however
        # chosen, gives an adapter's namespace, nor one adapter's namespace another's.
        h = hashlib.blake2b(len(text).to_bytes(8, "little") + text, digest_size=16, person=b"lora")
        h.update(lora_id.encode("utf-8", "surrogatepass"))
        return h.hexdigest()
    if not parts:
        return None
    return hashlib.blake2b(text, digest_size=16).hexdigest()


def _per_item(value: Any, size: int, name: str, is_batch: bool) -> list[Any]:
    """A batch field is either one value for all items or a list with one value per item."""
    defaults = {"sampling_params": None, "rid": None, "return_logprob": False}
    defaults |= {"logprob_start_len": -1, "top_logprobs_num": 0, "return_hidden_states": False}
    defaults |= {"custom_logit_processor": None, "priority": None, "lora_path": None, "return_routed_experts": False}
    defaults |= {"require_reasoning": False, "max_thinking_tokens": None}
    defaults |= dict.fromkeys(BOOTSTRAP_FIELDS + NAMESPACE_FIELDS)
    if value is None:
        value = defaults[name]
    if is_batch and isinstance(value, list):
        if len(value) != size:
            raise RequestError(f"{name} has {len(value)} entries for a batch of {size} prompts.", name)
        return [defaults[name] if v is None else v for v in value]
    if isinstance(value, list) and name != "sampling_params":
        raise RequestError(f"{name} must be a single value for a single prompt.", name, "invalid_type")
    return [value] * size
