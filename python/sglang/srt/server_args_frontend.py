"""The OpenAI front end's flags, with upstream SGLang's names and meaning: the chat template and its default
variables, the sampling defaults of every request, usage in streams, prompts cut to the limit, TLS, the
waiting queue's bound, the Responses API's store, and the HTTP metrics' histogram buckets. Their command line and their checks, each refusal one sentence naming the flag
(docs/server.md, "Chat template, sampling defaults, truncation, TLS and the queue").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sglang.srt.metrics.token_buckets import token_buckets
from sglang.srt.server_args_checks import ServerArgsError

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)
SECRET = {"secret": True}


@dataclass
class FrontendArgs:
    """ServerArgs' front-end fields (a base class, so `server_args.py` stays small)."""

    # A Jinja chat template file replacing the tokenizer's (upstream: also a built-in name or a .json
    # conversation template, neither built here: refused); read at start (`read_chat_template`).
    chat_template: str | None = None
    # Template variables every chat request gets unless its chat_template_kwargs names them (a JSON object).
    default_chat_template_kwargs: dict[str, Any] | None = None
    # sampling_params every request gets for the fields it leaves unset (a JSON object; /get_model_info).
    preferred_sampling_params: dict[str, Any] | None = None
    # Streamed OpenAI replies end with a usage event even without stream_options.include_usage.
    stream_response_default_include_usage: bool = False
    # A prompt over the input limit keeps its first tokens (upstream: the end is dropped) instead of a 400.
    allow_auto_truncate: bool = False
    # Requests waiting for their first batch, at most; one more is refused with 503 (not under PD).
    max_queued_requests: int | None = None
    # The Responses API's store (GET /v1/responses/{id}, previous_response_id, background), in the HTTP
    # process's memory, at most response_store_max_mb of JSON (least recently used dropped first).
    enable_response_store: bool = False
    response_store_max_mb: int = 256
    # /metrics' histogram bounds (seconds, ascending), upstream's flags; None: the defaults (metrics/collector.py).
    bucket_time_to_first_token: list[float] | None = None
    bucket_inter_token_latency: list[float] | None = None
    bucket_e2e_request_latency: list[float] | None = None
    # The token histograms' bucket rules (`metrics/token_buckets.py`); None: upstream's default.
    prompt_tokens_buckets: list[str] | None = None
    generation_tokens_buckets: list[str] | None = None
    collect_tokens_histogram: bool = False  # (upstream's deprecated switch: they are always collected)
    # Log a garbage collection that took longer than this (seconds) in every process; 0: off.
    gc_warning_threshold_secs: float = 0.0
    # With --log-requests: uvicorn's access lines of paths with these prefixes are left out.
    uvicorn_access_log_exclude_prefixes: list[str] = field(default_factory=list)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_keyfile_password: str | None = field(default=None, metadata=SECRET)


def add_frontend_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("OpenAI front end", "Upstream's flags: docs/server.md.")
    g.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE.jinja",
        help="A Jinja chat template file to use instead of the checkpoint's (tokenizer_config.json) for "
        "/v1/chat/completions.",
    )
    g.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help='Template variables for every chat request, e.g. \'{"enable_thinking": false}\'; a request\'s '
        "own chat_template_kwargs win, key by key.",
    )
    g.add_argument(
        "--preferred-sampling-params",
        default=None,
        metavar="JSON",
        help="sampling_params every request (native and OpenAI) gets for the fields it leaves unset, e.g. "
        '\'{"temperature": 0.6}\'; a chat request\'s defaults from the checkpoint\'s generation_config.json come '
        "first. Shown in /get_model_info.",
    )
    g.add_argument(
        "--stream-response-default-include-usage",
        action="store_true",
        help="Streamed OpenAI replies end with a usage event even without stream_options.include_usage.",
    )
    g.add_argument(
        "--allow-auto-truncate",
        action="store_true",
        help="A prompt longer than the server accepts keeps its first tokens (its end is dropped, as "
        "upstream) instead of getting 400; prompts with images or video are not cut.",
    )
    g.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="Requests waiting for their first batch, at most; one more gets 503 'The request queue is "
        "full.' (each data-parallel rank's queue; ignored under PD disaggregation, as upstream).",
    )
    g.add_argument(
        "--enable-response-store",
        action="store_true",
        help="Keep /v1/responses answers (store: true) in memory for GET /v1/responses/{id}, "
        "previous_response_id and background responses (not under --disaggregation-mode, as upstream).",
    )
    g.add_argument(
        "--response-store-max-mb",
        type=int,
        default=256,
        help="The response store's bound (JSON megabytes); the least recently used response goes first.",
    )
    for flag, what in (("time-to-first-token", "time to first token"), ("inter-token-latency", "inter-token "
                       "latency"), ("e2e-request-latency", "end-to-end request latency")):  # fmt: skip
        g.add_argument(
            f"--bucket-{flag}",
            type=float,
            nargs="+",
            default=None,
            metavar="SECONDS",
            help=f"The bucket bounds of /metrics' {what} histogram (--enable-metrics), ascending.",
        )
    for flag in ("prompt", "generation"):
        g.add_argument(
            f"--{flag}-tokens-buckets",
            nargs="+",
            default=None,
            help=f"The buckets of /metrics' {flag} tokens histogram: default, tse MIDDLE BASE COUNT, or custom B1 B2 ...",
        )
    g.add_argument("--collect-tokens-histogram", action="store_true")
    g.add_argument(
        "--gc-warning-threshold-secs",
        type=float,
        default=0.0,
        help="Log a garbage collection longer than this many seconds, in every process (0: off).",
    )
    g.add_argument(
        "--uvicorn-access-log-exclude-prefixes",
        nargs="*",
        default=[],
        help="Leave out of the access log (--log-requests) the requests whose path starts with one of these.",
    )
    g.add_argument("--ssl-keyfile", default=None, help="Serve HTTPS with this private key (PEM).")
    g.add_argument("--ssl-certfile", default=None, help="... and this certificate chain (PEM).")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates (PEM), as uvicorn's ssl_ca_certs.")
    g.add_argument("--ssl-keyfile-password", default=None, help="The private key's password.")


def _json_object(flag: str, value: Any) -> dict[str, Any] | None:
    """A flag's JSON object (a string from the command line, a dict from Engine(...))."""
    if value is None or isinstance(value, dict):
        return value
    try:
        parsed = json.loads(value)
    except (TypeError, ValueError) as e:
        raise ServerArgsError(f"{flag} must be a JSON object: {e}.") from None
    if not isinstance(parsed, dict):
        raise ServerArgsError(f"{flag} must be a JSON object, got {type(parsed).__name__}.")
    return parsed


def check_frontend_flags(args: ServerArgs) -> None:
    """Parse and check the front end's flags (ServerArgsError: one sentence naming the flag)."""
    from sglang.srt.sampling.sampling_params import SamplingParams, SamplingParamsError

    args.default_chat_template_kwargs = _json_object(
        "--default-chat-template-kwargs", args.default_chat_template_kwargs
    )
    # (transformers' and the chat server's imports only where there is something to check: ~1.4 s on a
    # 2-core VM before the scheduler could start; the HTTP process imports them later, beside it)
    given = set(args.default_chat_template_kwargs or {})
    named = sorted(given & _template_call_arguments()) if given else []
    if named:
        raise ServerArgsError(
            f"--default-chat-template-kwargs: {named[0]} is an argument of the chat template call, not a "
            "template variable."
        )
    args.preferred_sampling_params = _json_object("--preferred-sampling-params", args.preferred_sampling_params)
    if args.preferred_sampling_params:
        if "n" in args.preferred_sampling_params:
            raise ServerArgsError(
                "--preferred-sampling-params cannot set n: how many samples a request makes is its own "
                "(and bounded by --max-samples-per-request)."
            )
        try:  # (the vocabulary is checked per request, as a request's own fields are)
            SamplingParams.from_dict(args.preferred_sampling_params).verify()
        except (SamplingParamsError, TypeError) as e:
            raise ServerArgsError(f"--preferred-sampling-params: {e}") from None
    if args.chat_template is not None:
        read_chat_template(args.chat_template)  # (read again where the tokenizer is: the HTTP process)
    if args.max_queued_requests is not None and args.max_queued_requests < 1:
        raise ServerArgsError(f"--max-queued-requests must be at least 1, got {args.max_queued_requests}.")
    if args.max_queued_requests is not None and args.disaggregation_mode != "null":
        logger.warning("--max-queued-requests has no effect under --disaggregation-mode (as upstream's).")
    for name in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        bounds = getattr(args, f"bucket_{name}")
        if bounds is not None and (not bounds or any(not b > 0 for b in bounds) or sorted(set(bounds)) != list(bounds)):
            flag = "--bucket-" + name.replace("_", "-")
            raise ServerArgsError(f"{flag} takes positive bounds in ascending order, each once; got {bounds}.")
    for flag in ("prompt", "generation"):
        try:
            token_buckets(getattr(args, f"{flag}_tokens_buckets"), f"--{flag}-tokens-buckets")
        except ValueError as e:
            raise ServerArgsError(str(e)) from None
    if not args.gc_warning_threshold_secs >= 0:
        raise ServerArgsError(f"--gc-warning-threshold-secs must be 0 or more, got {args.gc_warning_threshold_secs}.")
    if args.response_store_max_mb < 1:
        raise ServerArgsError(f"--response-store-max-mb must be at least 1, got {args.response_store_max_mb}.")
    if args.enable_response_store and args.disaggregation_mode != "null":
        raise ServerArgsError(
            "--enable-response-store is not supported with --disaggregation-mode (as upstream): a stored "
            "response lives in one server's memory; serve the Responses API without storing instead."
        )
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise ServerArgsError("--ssl-keyfile and --ssl-certfile go together: give both to serve HTTPS.")
    for flag, path in (("--ssl-keyfile", args.ssl_keyfile), ("--ssl-certfile", args.ssl_certfile),
                       ("--ssl-ca-certs", args.ssl_ca_certs)):  # fmt: skip
        if path is not None and not os.path.isfile(path):
            raise ServerArgsError(f"{flag} {path} is not a file.")
    if (args.ssl_ca_certs or args.ssl_keyfile_password) and args.ssl_keyfile is None:
        raise ServerArgsError("--ssl-ca-certs and --ssl-keyfile-password need --ssl-keyfile and --ssl-certfile.")


def _template_call_arguments() -> set[str]:
    """The named parameters of transformers' `apply_chat_template` (what a request's chat_template_kwargs
    may not name either: `serving_chat`)."""
    from transformers import PreTrainedTokenizerBase

    from sglang.srt.entrypoints.openai.serving_chat import template_arguments

    return template_arguments(PreTrainedTokenizerBase) - {"self"}


def read_chat_template(path: str) -> str:
    """The text of a Jinja chat template file (a literal backslash-n in it is a newline, as upstream reads
    it), or ServerArgsError."""
    if not path.endswith(".jinja"):
        raise ServerArgsError(
            f"--chat-template {path}: this server takes a Jinja template file (.jinja); upstream's built-in "
            "template names and .json conversation templates are not built: write the template as .jinja."
        )
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ServerArgsError(f"--chat-template {path} cannot be read: {e.strerror or e}.") from None
    return text.replace("\\n", "\n")


def uvicorn_ssl(args: ServerArgs) -> dict[str, Any]:
    """uvicorn.Config's TLS arguments (none without --ssl-keyfile)."""
    if args.ssl_keyfile is None:
        return {}
    return {"ssl_keyfile": args.ssl_keyfile, "ssl_certfile": args.ssl_certfile,
            "ssl_ca_certs": args.ssl_ca_certs, "ssl_keyfile_password": args.ssl_keyfile_password}  # fmt: skip


class _AccessPathFilter(logging.Filter):
    """Drops uvicorn's access lines of paths with one of `prefixes` (its record's args: client, method,
    path, HTTP version, status)."""

    def __init__(self, prefixes: list[str]):
        super().__init__()
        self.prefixes = tuple(prefixes)

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        path = args[2] if isinstance(args, tuple) and len(args) >= 3 else ""
        return not (isinstance(path, str) and path.startswith(self.prefixes))


def filter_access_log(args: ServerArgs) -> None:
    """--uvicorn-access-log-exclude-prefixes (after uvicorn configured its loggers)."""
    if args.uvicorn_access_log_exclude_prefixes:
        logging.getLogger("uvicorn.access").addFilter(_AccessPathFilter(args.uvicorn_access_log_exclude_prefixes))
