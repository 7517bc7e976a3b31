"""Upstream SGLang's command-line flags, recognized: each flag of upstream's current release either works
here, or is parsed and refused at start with one sentence naming it and what to use instead. None is
silently ignored, and none stops the start with argparse's "unrecognized arguments".

The table (`server_args_upstream_table.py`) has three kinds of entries:
- refused (`REFUSED`, grouped by theme; `SPECIFIC` where a flag's own sentence says more): given at all,
  the start fails with ServerArgsError "<flag> is not supported by this server: <reason>.";
- accepted (`ACCEPTED`): the flag, or the values listed, ask for what this server does already (one GPU,
  cached tokens always reported, ...), `why` says so; any other value is refused the same way;
- aliases (`ALIASES`): upstream's names of flags this server has under another name.

The table never blocks an implementation: `add_upstream_cli_args` runs after `ServerArgs.add_cli_args`
and skips every flag the parser already knows, so whoever implements an upstream flag adds it to the
parser as usual and its entry here is ignored from then on (delete it when convenient); of an entry whose
names are partly known, the others become aliases of the parser's own flag. `Engine(**kwargs)` takes
upstream's keyword names through the same table (`upstream_engine_kwargs`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from functools import cache
from typing import Any

from sglang.srt.server_args_checks import ServerArgsError
from sglang.srt.server_args_upstream_table import ACCEPTED, ALIASES, REFUSED, SPECIFIC, THEMES, Accepted

# The namespace attribute the upstream flags given are recorded in, for `check_upstream_args`.
_GIVEN = "_upstream_flags_given"
_NARGS = {"": 0, "=": None, "+": "*", "?": "?"}


@dataclasses.dataclass(frozen=True)
class UpstreamFlag:
    """One entry of the table: upstream's names (first the primary), what it takes (see the table's
    docstring), and either the theme it is refused under or how it is accepted."""

    names: tuple[str, ...]
    arity: str
    theme: str | None = None
    accepted: Accepted | None = None

    def resolve(self, option: str, value: Any) -> dict[str, Any]:
        """The ServerArgs fields `option value` sets (most accepted flags set none); refused: raise
        ServerArgsError naming `option`."""
        if self.accepted is None:
            raise ServerArgsError(f"{option} is not supported by this server: {self.reason()}.")
        a = self.accepted
        if a.values is None:
            return {}
        shown = " ".join(value) if isinstance(value, list) else str(value)
        key = _canonical(a.kind, shown)
        if key in a.values:
            return dict(a.values[key])
        instead = THEMES.get(a.instead, a.instead)
        allowed = " or ".join(a.values)
        raise ServerArgsError(
            f"{option} {shown} is not supported by this server: {instead}; {option} {allowed} is accepted "
            f"({a.why})."
        )

    def reason(self) -> str:
        for name in self.names:
            if name in SPECIFIC:
                return SPECIFIC[name]
        return THEMES[self.theme] if self.theme else ""


def parse_spec(spec: str) -> tuple[tuple[str, ...], str]:
    """ "--a|--b=" -> (("--a", "--b"), "=")."""
    arity = spec[-1] if spec[-1] in "=+?" else ""
    return tuple(spec.rstrip("=+?").split("|")), arity


@cache
def upstream_table() -> tuple[UpstreamFlag, ...]:
    entries = []
    for theme, specs in REFUSED.items():
        for spec in specs.split():
            entries.append(UpstreamFlag(*parse_spec(spec), theme=theme))
    for a in ACCEPTED:
        entries.append(UpstreamFlag(*parse_spec(a.spec), accepted=a))
    return tuple(entries)


class _Record(argparse.Action):
    """Records the upstream flag given (its spelling, value and entry); judged after parsing."""

    def __init__(self, option_strings: list[str], dest: str, entry: UpstreamFlag, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.entry = entry

    def __call__(self, parser, namespace, values, option_string=None) -> None:  # noqa: ANN001
        given = list(getattr(namespace, self.dest, None) or [])
        given.append((option_string, values, self.entry))
        setattr(namespace, self.dest, given)


def add_upstream_cli_args(parser: argparse.ArgumentParser) -> None:
    """Adds every upstream flag `parser` does not know yet (call it after `ServerArgs.add_cli_args`)."""
    known = parser._option_string_actions
    group = parser.add_argument_group(
        "upstream SGLang flags",
        "Upstream's other flags are parsed too: each is refused at start with a sentence saying what to "
        "use instead, or accepted where it asks for what this server does already (docs/server.md, "
        "'Upstream flags').",
    )
    for name, ours in ALIASES.items():
        if name not in known and ours in known:
            _add_alias(group, name, known[ours])
    for entry in upstream_table():
        present = [n for n in entry.names if n in known]
        if present:
            for name in entry.names:
                if name not in known:
                    _add_alias(group, name, known[present[0]])
            continue
        group.add_argument(
            *entry.names,
            action=_Record,
            entry=entry,
            nargs=_NARGS[entry.arity],
            dest=_GIVEN,
            default=argparse.SUPPRESS,
            help=argparse.SUPPRESS,
        )


def _add_alias(group: argparse._ArgumentGroup, name: str, action: argparse.Action) -> None:
    # SUPPRESS: the alias must not reset the default the parser's own flag puts in the namespace.
    kwargs: dict[str, Any] = {"dest": action.dest, "default": argparse.SUPPRESS, "help": argparse.SUPPRESS}
    if action.nargs == 0:
        kwargs.update(action="store_const", const=action.const)
    else:
        kwargs.update(nargs=action.nargs, type=action.type, choices=action.choices, metavar=action.metavar)
    group.add_argument(name, **kwargs)


def check_upstream_args(namespace: argparse.Namespace) -> None:
    """After parsing: refuses an upstream flag given that is refused (ServerArgsError, one sentence naming
    it), and applies what an accepted one sets."""
    for option, value, entry in vars(namespace).pop(_GIVEN, []):
        for name, field_value in entry.resolve(option, value).items():
            setattr(namespace, name, field_value)


def upstream_engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`Engine(**kwargs)` with upstream's keyword names (its flags' dest names): an alias of one of this
    server's fields is renamed to it, a refused one raises ServerArgsError as its flag does, an accepted
    one is checked and dropped. None or False is upstream's "unset" or "off" and is dropped; names
    upstream does not have either are left for ServerArgs to refuse."""
    from sglang.srt.server_args import ServerArgs

    fields = {f.name for f in dataclasses.fields(ServerArgs)}
    if all(name in fields for name in kwargs):
        return kwargs
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    add_upstream_cli_args(parser)
    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        option = "--" + name.replace("_", "-")
        action = parser._option_string_actions.get(option)
        if name in fields or action is None or option == "--help":
            out[name] = value
        elif value is None or value is False:
            continue
        elif isinstance(action, _Record):
            out.update(action.entry.resolve(option, _as_cli_value(value, action.entry.arity)))
        else:
            out[action.dest] = value
    return out


def _as_cli_value(value: Any, arity: str) -> Any:
    if arity == "":
        return None
    if arity == "+":
        return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]
    return json.dumps(value) if isinstance(value, (dict, list)) else str(value)


def _canonical(kind: str, value: str) -> str:
    try:
        if kind == "int":
            return str(int(value))
        if kind == "json":
            return json.dumps(json.loads(value), sort_keys=True)
    except ValueError:
        pass
    return value


def upstream_flags_markdown() -> str:
    """docs/server.md's lists of upstream flags refused and accepted, from the table (without the entries
    the parser implements by now)."""
    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    entries = [e for e in upstream_table() if not any(n in parser._option_string_actions for n in e.names)]
    lines = ["Refused at start (`<flag> is not supported by this server: <reason>.`), by reason:", ""]
    for theme, reason in THEMES.items():
        names = [e.names[0] for e in entries if e.theme == theme]
        lines.append(f"- {reason[0].upper()}{reason[1:]}: " + ", ".join(f"`{n}`" for n in names) + ".")
    lines += ["", "Own sentences: " + "; ".join(f"`{k}`: {v}" for k, v in SPECIFIC.items()) + ".", ""]
    lines += ["Accepted, because they ask for what this server does already (other values are refused):", ""]
    for e in entries:
        if e.accepted is not None:
            values = f" {' / '.join(e.accepted.values)}" if e.accepted.values else ""
            lines.append(f"- `{e.names[0]}{values}`: {e.accepted.why}.")
    lines += ["", "Upstream's names of flags this server has: "]
    lines[-1] += ", ".join(f"`{k}` (`{v}`)" for k, v in ALIASES.items()) + "."
    return "\n".join(lines) + "\n"
