"""A request's grammar fields, as upstream's sampling parameters name them: `json_schema`, `regex`, `ebnf`
and `structural_tag` (at most one per request). Where the request comes in only the cheap checks run
(a string; one of them; a JSON schema or structural tag that is JSON): a 400 naming the field. The
grammar itself is parsed and compiled by the scheduler on a thread of its own (`xgrammar_backend.py`):
xgrammar's parse alone grows faster than linearly with some patterns (1.3 s for a 60-byte schema with
`[a-z]{1,6000}`), which would stall every client of the HTTP process, and a grammar it refuses ends
its request with a 400 naming the field all the same."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.sampling.sampling_params import SamplingParams

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")
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
    """Why a `kind` grammar's text is not the JSON it must be (a JSON schema or structural tag), or None."""
    if kind not in ("json_schema", "structural_tag") or text == ANY_JSON:
        return None
    try:
        json.loads(text)
    except ValueError as e:
        return f"{kind} is not valid: not JSON ({e})"
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
