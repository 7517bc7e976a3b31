"""Custom logit processors, upstream's (`--enable-custom-logit-processor`), at upstream's module path so
that a client's subclass serializes here as it does there.

A client subclasses `CustomLogitProcessor`, sends `MyProcessor.to_str()` as the request's
`custom_logit_processor` and its settings as `sampling_params.custom_params`. The scheduler loads the
class (`load_processor`: dill, so only with the flag: loading runs the client's code) and each batch
calls `processor(logits, custom_param_list)` on the logits rows of the requests that name it, after
the penalties and the grammar mask and before sampling, as upstream orders them. Each row's params are
its request's `custom_params` plus `"__req__"`, the request itself (its `output_ids`, as upstream's
thinking-budget processors read them). A processor that raises ends its requests with a 400; the
others in the batch are not touched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import torch

from sglang.srt.environ import envs
from sglang.srt.utils.host_tensors import host_int64

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req

Params = list[dict[str, Any]]  # one dict per logits row: the request's custom_params and "__req__"


class CustomLogitProcessor(ABC):
    """Upstream's interface: `__call__` gets the logits of the rows using this processor ([n, vocab])
    and one params dict per row, and returns them changed (in place or new, same shape)."""

    @abstractmethod
    def __call__(self, logits: torch.Tensor, custom_param_list: Params | None = None) -> torch.Tensor:
        raise NotImplementedError

    @classmethod
    def to_str(cls) -> str:
        """The request's `custom_logit_processor`: the class, serialized by dill, as upstream's JSON;
        signed where SGLANG_LOGIT_PROCESSOR_SECRET is set (as the server that checks it must be)."""
        import dill

        blob = dill.dumps(cls)
        data = {"callable": blob.hex()}
        secret = envs.SGLANG_LOGIT_PROCESSOR_SECRET.get()
        if secret:
            data["signature"] = _signature(secret, blob)
        return json.dumps(data)

    @classmethod
    def from_str(cls, json_str: str) -> CustomLogitProcessor:
        return load_processor(json_str)


class DisallowedTokensLogitsProcessor(CustomLogitProcessor):
    """Upstream's: the ids in custom_params["token_ids"] are never sampled."""

    def __call__(self, logits: torch.Tensor, custom_param_list: Params | None = None) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or []):
            ids = params.get("token_ids") or []
            if ids:
                logits[row, ids] = float("-inf")
        return logits


class ThinkingBudgetLogitProcessor(CustomLogitProcessor):
    """Upstream's thinking budget: custom_params["thinking_budget"] (an integer >= 0) caps the tokens
    of the open thinking section (after the model's thinking-start token, in the prompt or the output,
    with no thinking-end token after it). Once it holds that many, the next tokens are forced: a
    newline (unless the last token is one), then the thinking-end token; after it the model answers
    freely. A subclass names its model's token ids. Each request's tokens are scanned once, as they
    come (a step costs the new tokens, not the whole output): the scan is kept on the request
    (`Req.custom_logit_state`)."""

    THINKING_START_TOKEN_ID: int
    THINKING_END_TOKEN_ID: int
    NEW_LINE_TOKEN_ID: int

    def __call__(self, logits: torch.Tensor, custom_param_list: Params | None = None) -> torch.Tensor:
        for row, params in enumerate(custom_param_list or []):
            budget = params.get("thinking_budget")
            if not isinstance(budget, int) or isinstance(budget, bool) or budget < 0:
                continue
            req = params["__req__"]
            prompt, outputs = req.origin_input_ids, req.output_ids
            start = self._open_section(req, prompt, outputs)
            total = len(prompt) + len(outputs)
            if start < 0 or total - start - 1 < budget:
                continue
            last = outputs[-1] if outputs else prompt[-1]
            forced = self.THINKING_END_TOKEN_ID if last == self.NEW_LINE_TOKEN_ID else self.NEW_LINE_TOKEN_ID
            logits[row] = float("-inf")
            logits[row, forced] = 0.0
        return logits

    def _open_section(self, req: Any, prompt: list[int], outputs: list[int]) -> int:
        """Where the thinking section open after `prompt + outputs` starts (its start token's index), or
        -1; continuing the request's last scan ((tokens scanned, that index) in its state)."""
        state = req.custom_logit_state
        total = len(prompt) + len(outputs)
        valid = isinstance(state, tuple) and len(state) == 2 and state[0] <= total
        scanned, start = state if valid else (0, -1)
        n = len(prompt)
        for i in range(scanned, total):
            token = prompt[i] if i < n else outputs[i - n]
            if token == self.THINKING_START_TOKEN_ID:
                start = i
            elif token == self.THINKING_END_TOKEN_ID:
                start = -1
        req.custom_logit_state = (total, start)
        return start


class Qwen3ThinkingBudgetLogitProcessor(ThinkingBudgetLogitProcessor):
    """Qwen3's and Qwen3-Next's tokenizer: <think> 151667, </think> 151668, a newline 198."""

    THINKING_START_TOKEN_ID = 151667
    THINKING_END_TOKEN_ID = 151668
    NEW_LINE_TOKEN_ID = 198


def _signature(secret: str, blob: bytes) -> str:
    return hmac.new(secret.encode(), blob, hashlib.sha256).hexdigest()


def load_processor(payload: str) -> CustomLogitProcessor:
    """An instance of the class a request's `custom_logit_processor` carries (one per payload and
    secret: a processor is shared by the requests that send the same class). ValueError saying why
    not, whatever the payload holds."""
    return _load(payload, envs.SGLANG_LOGIT_PROCESSOR_SECRET.get())


def load_processor_agreed(
    payload: str, agree: Callable[[str | None, str], str | None] | None = None
) -> tuple[CustomLogitProcessor | None, str | None]:
    """`load_processor`'s (processor, None), or (None, why not). Under tensor parallelism (`agree`:
    `TpBroadcast.agree_outcome`) every rank takes the same outcome: loading runs the client's code on
    each rank, and a payload that loads on some ranks only must be refused on all of them (a request one
    rank refuses and another runs makes their batches differ, and the collectives hang)."""
    processor, error = None, None
    try:
        processor = load_processor(payload)
    except ValueError as e:
        error = str(e)
    if agree is not None:
        error = agree(error, "the request is refused on every rank")
    return (None, error) if error is not None else (processor, None)


@lru_cache(maxsize=64)
def _load(payload: str, secret: str) -> CustomLogitProcessor:
    try:
        data = json.loads(payload)
        blob = bytes.fromhex(data["callable"])
        signature = data.get("signature")
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        raise ValueError(
            'custom_logit_processor must be the JSON that CustomLogitProcessor.to_str() makes ({"callable": '
            "hex})."
        ) from None
    signed = isinstance(signature, str) and hmac.compare_digest(
        signature.encode("utf-8", "replace"), _signature(secret, blob).encode()
    )
    if secret and not signed:
        # Checked before anything is unpickled: an unsigned payload's code never runs.
        raise ValueError(
            "custom_logit_processor is not signed with this server's SGLANG_LOGIT_PROCESSOR_SECRET (make it "
            "with CustomLogitProcessor.to_str() where the same secret is set)."
        )
    import dill

    try:
        obj = dill.loads(blob)
        if isinstance(obj, type) and issubclass(obj, CustomLogitProcessor):
            obj = obj()  # (an abstract class, or one whose constructor takes arguments, raises here)
    except Exception as e:  # noqa: BLE001 - whatever loading raises is the payload's fault
        raise ValueError(f"custom_logit_processor cannot be loaded ({type(e).__name__}: {e}).") from None
    if not callable(obj):
        raise ValueError(f"custom_logit_processor holds a {type(obj).__name__}, not a logit processor.")
    return obj


@dataclass
class CustomLogitInfo:
    """A batch's custom logit processors: `rows` [P] the logits rows that have one, grouped by
    processor (`sizes` rows each); per group the processor, each row's params and whose row it is.
    `errors` (request id -> message) is filled where a processor raised, on the forward stream, and read
    by the scheduler when it processes the batch."""

    rows: torch.Tensor
    sizes: list[int]
    processors: list[CustomLogitProcessor]
    params: list[list[dict[str, Any]]]
    rids: list[list[str]]
    errors: dict[str, str] = field(default_factory=dict)

    TENSOR_FIELDS = ("rows",)

    @classmethod
    def build(cls, reqs: Sequence[Req], sample_rows: Sequence[bool]) -> CustomLogitInfo | None:
        groups: dict[int, tuple[CustomLogitProcessor, list[int], list[Req]]] = {}
        for i, req in enumerate(reqs):
            proc = req.custom_logit_processor
            if proc is not None and sample_rows[i]:
                groups.setdefault(id(proc), (proc, [], []))
                groups[id(proc)][1].append(i)
                groups[id(proc)][2].append(req)
        if not groups:
            return None
        values = list(groups.values())
        return cls(
            rows=host_int64([i for _, rows, _ in values for i in rows]),
            sizes=[len(rows) for _, rows, _ in values],
            processors=[proc for proc, _, _ in values],
            params=[[_params_of(r) for r in rs] for _, _, rs in values],
            rids=[[r.rid for r in rs] for _, _, rs in values],
        )

    def at_logit_rows(self, logit_rows: Sequence[int]) -> CustomLogitInfo:
        """The same where request i's logits are row `logit_rows[i]` (a speculative verify, whose requests
        with a processor have one position each); host tensors, before the batch moves."""
        return replace(self, rows=host_int64(logit_rows).index_select(0, self.rows), errors={})


def _params_of(req: Req) -> dict[str, Any]:
    return {**(req.sampling_params.custom_params or {}), "__req__": req}


def apply_custom_logit_processors(logits: torch.Tensor, info: CustomLogitInfo) -> torch.Tensor:
    """`logits` [bs, vocab] with each group's rows replaced by what its processor returns. A processor
    that raises, or returns another shape, leaves its rows as they were and records the error for each
    of its requests (`info.errors`)."""
    for proc, rows, params, rids in zip(
        info.processors, info.rows.split(info.sizes), info.params, info.rids, strict=True
    ):
        sub = logits.index_select(0, rows)
        try:
            out = proc(sub, params)
            if not isinstance(out, torch.Tensor) or out.shape != sub.shape:
                got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
                raise ValueError(f"it returned {got} for logits of shape {tuple(sub.shape)}")
            logits.index_copy_(0, rows, out.to(logits.device, logits.dtype))
        except Exception as e:  # noqa: BLE001 - the client's code: its requests fail, nothing else
            message = f"The custom_logit_processor failed: {type(e).__name__}: {e}."
            info.errors.update(dict.fromkeys(rids, message))
    return logits
