"""One token-commit path: `BatchResultProcessor.commit` is the only code under `sglang.srt` that adds a
sampled token to a request's `output_ids` (prefill, decode and the speculative verify all call it), so a
feature that changes what committing a token means (logprobs, hidden states, the finish check) changes
one function; the decode token log's steps, which can end no request and want nothing but their tokens,
are committed beside it, in the same module (`commit_logged`). The scan reads the syntax tree:
`.output_ids.append/extend/insert(...)`, `.output_ids += ...` and `.output_ids[...] = ...` count, on
`output_ids` or `_output_ids`, directly or through a local name bound to the list in the same function
(`out = req.output_ids; out.append(t)`).

A plain `Req`: `output_ids` and `kv_indices` are slots, not properties whose read appends what the decode
logs hold, with no private twin, and nothing reaches them by a computed name (`getattr(req, attr)`, as
the logs did), which the scan could not see."""

from __future__ import annotations

import ast
import types
from pathlib import Path

from sglang.srt.managers.req import Req
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")

SRT = Path(__file__).resolve().parents[3] / "python" / "sglang" / "srt"
NAMES = {"output_ids", "_output_ids"}
COMMIT = "managers/scheduler_components/batch_result_processor.py:BatchResultProcessor.commit"
COMMIT_LOGGED = "managers/scheduler_components/batch_result_processor.py:commit_logged"
ALLOWED = {COMMIT, COMMIT_LOGGED}
LISTS = ("output_ids", "kv_indices")


def _is_ids(node: ast.AST) -> bool:
    """A request's list: `<name>.output_ids`, except a message's or the front end's own (`out.`, `self.`:
    `BatchTokenIDOut`, `ReqState`, which carry tokens already committed)."""
    return (
        isinstance(node, ast.Attribute)
        and node.attr in NAMES
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "out"))
    )


def appenders(source: str, where: str) -> set[str]:
    """`where:Class.function` for each function in `source` that adds to an `output_ids` list."""
    found: set[str] = set()
    # Local names bound to a request's list (`out = req.output_ids`), per function: appends through them
    # count as appends to the list.
    aliases: dict[str, set[str]] = {}

    def is_list(node: ast.AST, scope: list[str]) -> bool:
        alias = isinstance(node, ast.Name) and node.id in aliases.get(".".join(scope), set())
        return _is_ids(node) or alias

    def visit(node: ast.AST, scope: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            scope = scope + [node.name]
        if isinstance(node, ast.Assign) and _is_ids(node.value):
            names = {t.id for t in node.targets if isinstance(t, ast.Name)}
            aliases.setdefault(".".join(scope), set()).update(names)
        hit = (
            (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("append", "extend", "insert")
                and is_list(node.func.value, scope)
            )
            or (isinstance(node, ast.AugAssign) and is_list(node.target, scope))
            or (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Subscript) and _is_ids(t.value) for t in node.targets)
            )
        )
        if hit:
            found.add(f"{where}:{'.'.join(scope)}")
        for child in ast.iter_child_nodes(node):
            visit(child, scope)

    visit(ast.parse(source), [])
    return found


def test_commit_is_the_only_place_that_appends_to_output_ids():
    found: set[str] = set()
    for path in SRT.rglob("*.py"):
        found |= appenders(path.read_text(), path.relative_to(SRT).as_posix())
    assert ALLOWED <= found, "the scan finds commit's own appends"
    assert found <= ALLOWED, f"output_ids grows outside commit: {sorted(found - ALLOWED)}"


def test_the_scan_sees_each_form_of_append():
    source = """
class Helper:
    def a(self, req): req.output_ids.append(1)
    def b(self, req): req._output_ids.extend([1])
    def c(self, req): req.output_ids += [1]
    def d(self, req): req.output_ids[len(req.output_ids):] = [1]
    def e(self, req): n = len(req.output_ids)
    def f(self, req):
        out = req._output_ids
        out.append(1)
    def g(self, out): out.append(1)
"""
    assert appenders(source, "x.py") == {f"x.py:Helper.{f}" for f in "abcdf"}


def test_req_lists_are_plain_slots():
    for name in LISTS:
        assert isinstance(Req.__dict__[name], types.MemberDescriptorType), f"Req.{name} is not a plain slot"
        assert f"_{name}" not in Req.__slots__
    req = Req("r", [1, 2])
    req.output_ids.append(7)
    assert req.output_ids == [7] and req.kv_indices == []


def _hidden_access(source: str) -> list[str]:
    """Private twins of the lists (`._output_ids`), and access to them through `getattr` / `setattr`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr in {f"_{n}" for n in LISTS}:
            found.append(f"line {node.lineno}: .{node.attr}")
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "setattr")
        ):
            name = node.args[1] if len(node.args) > 1 else None
            if isinstance(name, ast.Constant) and name.value in LISTS:
                found.append(f"line {node.lineno}: {node.func.id}(..., {name.value!r})")
    return found


def test_nothing_reaches_the_lists_by_a_private_twin_or_a_computed_name():
    found = {}
    for path in SRT.rglob("*.py"):
        hits = _hidden_access(path.read_text())
        if hits:
            found[path.relative_to(SRT).as_posix()] = hits
    assert not found, found
    planted = "def f(r, log):\n    getattr(r, 'kv_indices').extend(log)\n    r._output_ids.append(1)\n"
    assert len(_hidden_access(planted)) == 2
