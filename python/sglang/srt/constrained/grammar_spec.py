"""A request's grammar fields, as upstream's sampling parameters name them: `json_schema`, `regex`, `ebnf`
and `structural_tag` (at most one per request). Where the request comes in only the cheap checks run
(a string; one of them; a JSON schema or structural tag that is JSON, within the bounds below): a 400
naming the field. The grammar itself is parsed and compiled by the scheduler on a thread of its own
(`xgrammar_backend.py`): xgrammar's parse alone grows faster than linearly with some patterns (a
60-byte schema can take seconds), which would stall every client of the HTTP process, and a
grammar it refuses ends its request with a 400 naming the field all the same.

The bounds keep a compile from holding one of the scheduler's few compile threads for long (xgrammar
cannot stop one midway). Its time grows faster than linearly with a schema's nesting and with a schema
pattern's counted repeats (timings: benchmark/README.md). Real schemas stay far inside them: OpenAI's
structured outputs allow 10 levels of nesting, which a JSON schema writes in about 20-30 levels of
JSON (an object's field sits two levels below it, anyOf adds a list), under MAX_SCHEMA_DEPTH's 64."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

from sglang.srt.constrained.stop_regex import pattern_bound_error

if TYPE_CHECKING:
    from sglang.srt.sampling.sampling_params import SamplingParams

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
MAX_GRAMMAR_CHARS = 128 * 1024  # a grammar field's text (a body may hold 1.25 MB)
MAX_SCHEMA_DEPTH = 64  # JSON objects and arrays nested in a json_schema or structural_tag
MAX_SCHEMA_PATTERN_UNROLLED = 1000  # a schema pattern's counted repeats, multiplied (stop_regex.py)
# upstream's json_schema for "any JSON value" (its tool-call and json_object paths send it)
ANY_JSON = "$$ANY$$"

# xgrammar's messages start with a time stamp and its C++ source line: "[07:00:42] /project/cpp/x.cc:83: ".
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def grammar_key(sp: SamplingParams) -> tuple[str, str] | None:
    """(field, text) of the request's grammar, or None."""
    for name in GRAMMAR_FIELDS:
        value = getattr(sp, name)
        if value is not None:
            return name, value
    return None


def check_grammar_fields(sp: SamplingParams, error: type[Exception]) -> None:
    """Raise `error` naming the field when the grammar fields are wrong: not a string, more than one, or
    a JSON schema or structural tag that is not JSON. A json_schema sent as a JSON object becomes its
    text."""
    if isinstance(sp.json_schema, dict):
        sp.json_schema = json.dumps(sp.json_schema)
    given = [name for name in GRAMMAR_FIELDS if getattr(sp, name) is not None]
    for name in given:
        if not isinstance(getattr(sp, name), str):
            raise error(f"{name} must be a string.")
    if len(given) > 1:
        raise error(
            f"{given[1]} cannot be set together with {given[0]}: a request has at most one of "
            f"{', '.join(GRAMMAR_FIELDS)}."
        )
    if given:
        message = json_error(given[0], getattr(sp, given[0]))
        if message is not None:
            raise error(f"{message}.")


def json_error(kind: str, text: str) -> str | None:
    """Why a `kind` grammar's text is not what the compiler takes (too large; for a JSON schema or
    structural tag, not JSON, nested too deep or a pattern repeated too long), or None."""
    if len(text) > MAX_GRAMMAR_CHARS:
        return f"{kind} has {len(text):,} characters; at most {MAX_GRAMMAR_CHARS:,} are allowed"
    if kind not in ("json_schema", "structural_tag") or text == ANY_JSON:
        return None
    try:
        value = json.loads(text)
    except ValueError as e:
        return f"{kind} is not valid: not JSON ({e})"
    except RecursionError:
        return (
            f"{kind} nests more than {MAX_SCHEMA_DEPTH} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed"
        )
    return _schema_bound_error(kind, value)


def _schema_bound_error(kind: str, value: Any) -> str | None:
    """Why a parsed schema or structural tag is nested too deep or has a pattern that repeats too long."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_SCHEMA_DEPTH:
            return f"{kind} nests more than {MAX_SCHEMA_DEPTH} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed"
        if isinstance(node, dict):
            patterns = (
                list(node.get("patternProperties") or {})
                if isinstance(node.get("patternProperties"), dict)
                else []
            )
            if isinstance(node.get("pattern"), str):
                patterns.append(node["pattern"])
            for pattern in patterns:
                why = pattern_bound_error(pattern, MAX_SCHEMA_PATTERN_UNROLLED)
                if why is not None:
                    return f"{kind} has a pattern {pattern[:60]!r} that {why}"
            stack.extend((v, depth + 1) for v in node.values() if isinstance(v, dict | list))
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node if isinstance(v, dict | list))
    return None


def error_text(e: BaseException) -> str:
    """xgrammar's message without its log prefix."""
    return _LOG_PREFIX.sub("", str(e)).strip().rstrip(".") or type(e).__name__


def structural_tag_grammar(text: str, compiler: Any) -> Any:
    """A structural tag in either of upstream's forms, compiled: the legacy {"structures": [{"begin",
    "schema", "end"}], "triggers": [...]}, or xgrammar's own ({"type": "structural_tag", "format":
    ...})."""
    import xgrammar as xgr

    tag = json.loads(text)
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        args = (items, tag.get("triggers", []))
    else:
        args = (text,)
    return compiler.compile_structural_tag(*args)
