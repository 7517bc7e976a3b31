"""A request's grammar fields, as upstream's sampling parameters name them: `json_schema`, `regex`, `ebnf`
and `structural_tag` (at most one per request). Checked where the request comes in: a field of the
wrong type, two of them at once, or text xgrammar cannot parse is a 400 naming the field. The parse
(`xgrammar.Grammar.from_*`, ~0.1 ms for a small schema) needs no tokenizer; the scheduler compiles the
grammar against the vocabulary later (`xgrammar_backend.py`)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sglang.srt.sampling.sampling_params import SamplingParams

GRAMMAR_FIELDS = ("json_schema", "regex", "ebnf", "structural_tag")

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
    """Raise `error` naming the field when the grammar fields are wrong: not a string, more than one,
    or text that does not parse as its kind. A json_schema sent as a JSON object becomes its text."""
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
        name = given[0]
        message = parse_error(name, getattr(sp, name))
        if message is not None:
            raise error(f"{name} is not valid: {message}.")


def parse_error(kind: str, text: str) -> str | None:
    """Why xgrammar cannot parse `text` as a `kind` grammar, or None."""
    import xgrammar as xgr

    try:
        if kind == "json_schema":
            xgr.Grammar.from_json_schema(json.loads(text))
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(text)
        else:
            structural_tag_grammar(text)
    except json.JSONDecodeError as e:
        return f"not JSON ({e})."
    except Exception as e:  # noqa: BLE001  (xgrammar raises RuntimeError, ValueError, TypeError, its own)
        return error_text(e)
    return None


def error_text(e: BaseException) -> str:
    """xgrammar's message without its log prefix."""
    return _LOG_PREFIX.sub("", str(e)).strip().rstrip(".") or type(e).__name__


def structural_tag_grammar(text: str, compiler: Any = None) -> Any:
    """A structural tag in either of upstream's forms: the legacy {"structures": [{"begin", "schema",
    "end"}], "triggers": [...]}, or xgrammar's own ({"type": "structural_tag", "format": ...}). With
    `compiler` the compiled grammar, else the parsed one."""
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
    if compiler is None:
        return xgr.Grammar.from_structural_tag(*args)
    return compiler.compile_structural_tag(*args)
