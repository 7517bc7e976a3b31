"""Upstream's request log (`--log-requests`, `--log-requests-level`, `--log-requests-format`): one line
when a request arrives and one when it ends, from the HTTP process (the TokenizerManager's observers).

Levels, as upstream's: 0 the metadata (rid, token counts, finish reason, latency, stream, LoRA,
priority); 1 also the sampling parameters; 2 also the input and output, each cut to its first 2,048
characters (ids: 2,048 of them), as upstream cuts them; 3 all of them, whole. Formats: `text` (`Receive:
rid=..., ...` and `Finish: ...`, the values as Python shows them) or `json` (one object a line:
`{"event": "request.received" | "request.finished" | "request.aborted", "timestamp", ...}`).
The server's own requests (its warm-up, /health_generate) are not logged; every client's is, whatever
its `log_metrics` (which only keeps it out of the metrics, as upstream's).

`Observers` is what `TokenizerManager.observer` holds: the metrics collector and this log, each told of
the events it has a method for.
"""

from __future__ import annotations

import datetime
import json
import logging
import math
import time
from typing import Any

import orjson

logger = logging.getLogger("sglang.request_log")

CUT = 2048  # level 2: the characters of a text (or the ids) a line keeps, as upstream's


class Observers:
    """The TokenizerManager's observers: each event goes to those that have a method for it. An observer
    that fails is logged, never the request's failure (its reply, or the other requests of a message)."""

    def __init__(self, *observers: Any):
        self.observers = [o for o in observers if o is not None]

    def __bool__(self) -> bool:
        return bool(self.observers)

    def _tell(self, event: str, *args: Any) -> None:
        for o in self.observers:
            method = getattr(o, event, None)
            if method is None:
                continue
            try:
                method(*args)
            except Exception:  # noqa: BLE001 - observing must not fail what it observes
                logger.exception("%s.%s failed.", type(o).__name__, event)

    def on_arrival(self, states: list[Any]) -> None:
        self._tell("on_arrival", states)

    def on_message(self, state: Any, first: bool, num_new_tokens: int) -> None:
        """A message of the scheduler's reached `state` (`first`: its first tokens; `num_new_tokens`)."""
        if first:
            self._tell("on_first_token", state)
        elif num_new_tokens:
            self._tell("on_tokens", state, num_new_tokens)
        if state.finished:
            self._tell("on_finish", state)

    def on_abort(self, state: Any) -> None:
        self._tell("on_abort", state)


def observers(server_args: Any, *others: Any) -> Observers | None:
    """What a TokenizerManager observes with: `others` (the metrics) and, with --log-requests, the
    request log."""
    log = RequestLog(server_args.log_requests_level, server_args.log_requests_format)
    found = Observers(*others, log if server_args.log_requests else None)
    return found if found else None


def configure_logging(data: Any, server_args: Any, current: Observers | None) -> Observers | None:
    """Upstream's /configure_logging body applied to this process: `log_requests`, `log_requests_level`,
    `log_requests_format` (the request log made anew; returns the observers to use) and `log_level` (this
    process's loggers). Its request dumps are not built: those fields refused naming them."""
    from sglang.srt.managers.request_validation import RequestError
    from sglang.srt.server_args_checks import LOG_LEVELS

    data = {} if data is None else data
    if not isinstance(data, dict):
        raise RequestError("The body must be a JSON object of /configure_logging's fields.", None)
    checks = {
        "log_requests": (lambda v: isinstance(v, bool), "true or false"),
        "log_requests_level": (lambda v: v in (0, 1, 2, 3) and not isinstance(v, bool), "0, 1, 2 or 3"),
        "log_requests_format": (lambda v: v in ("text", "json"), "text or json"),
        "log_level": (lambda v: isinstance(v, str) and v.lower() in LOG_LEVELS, ", ".join(LOG_LEVELS)),
    }
    dumps = (
        "dump_requests_folder",
        "dump_requests_threshold",
        "crash_dump_folder",
        "dump_requests_exclude_meta_keys",
    )
    for name, value in data.items():
        if name in dumps:
            if value is not None:
                raise RequestError(f"{name}: request dumps are not built here; use log_requests.", name)
        elif name not in checks:
            raise RequestError(f"{name} is not a field of /configure_logging.", name)
        elif value is not None and not checks[name][0](value):
            raise RequestError(f"{name} must be {checks[name][1]}, got {value!r}.", name)
    for name in ("log_requests", "log_requests_level", "log_requests_format"):
        if data.get(name) is not None:
            setattr(server_args, name, data[name])
    if data.get("log_level") is not None:
        logging.getLogger().setLevel(data["log_level"].upper())
    kept = [o for o in (current.observers if current else []) if not isinstance(o, RequestLog)]
    return observers(server_args, *kept)


class RequestLog:
    def __init__(self, level: int, fmt: str):
        self.level, self.fmt = level, fmt

    def _cut(self, value: Any) -> Any:
        if self.level >= 3 or value is None or len(value) <= CUT:
            return value
        return value[:CUT] + ("..." if isinstance(value, str) else ["..."])

    def _emit(self, event: str, head: str, fields: dict[str, Any]) -> None:
        if self.fmt == "json":
            stamp = datetime.datetime.now(datetime.timezone.utc).isoformat()
            body = {"event": event, "timestamp": stamp, **fields}
            try:
                line = orjson.dumps(body, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
            except TypeError:  # (an integer past 64 bits: a seed, a stop id, a custom parameter)
                line = json.dumps(_finite(body), default=str)
        else:
            line = f"{head}: " + ", ".join(f"{k}={v!r}" for k, v in fields.items())
        logger.info(line)

    def on_arrival(self, states: list[Any]) -> None:
        for state in states:
            req = state.req
            if req.warmup:  # (the server's own: its warm-up and /health_generate)
                continue
            fields: dict[str, Any] = {
                "rid": req.rid,
                "prompt_tokens": len(req.input_ids),
                "stream": req.stream,
            }
            if req.lora_id is not None:
                fields["lora_id"] = req.lora_id
            if req.priority is not None:
                fields["priority"] = req.priority
            if self.level >= 1:
                params = req.sampling_params.to_dict()
                fields["sampling_params"] = {k: v for k, v in params.items() if v is not None and v != []}
            if self.level >= 2:
                if req.input_text is not None:
                    fields["text"] = self._cut(req.input_text)
                fields["input_ids"] = self._cut(req.input_ids)
            self._emit("request.received", "Receive", fields)

    def _end(self, state: Any, event: str, head: str) -> None:
        if state.req.warmup:
            return
        fields: dict[str, Any] = {
            "rid": state.rid,
            "finish_reason": state.finished_reason,
            "prompt_tokens": state.prompt_tokens,
            "completion_tokens": state.completion_tokens,
            "cached_tokens": state.cached_tokens,
            "e2e_latency": round((state.finish_time or time.time()) - state.created_time, 6),
        }
        if self.level >= 2:
            fields["out_text"] = self._cut(state.text)
            fields["output_ids"] = self._cut(state.output_ids)
        self._emit(event, head, fields)

    def on_finish(self, state: Any) -> None:
        self._end(state, "request.finished", "Finish")

    def on_abort(self, state: Any) -> None:
        """The caller went away before the request finished (its stream closed, its client left)."""
        self._end(state, "request.aborted", "Abort")


def _finite(value: Any) -> Any:
    """`value` with its non-finite floats as None (JSON has no NaN, which orjson writes as null)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value
