"""One token-commit path: `BatchResultProcessor.commit` is the only code under `sglang.srt` that adds a
sampled token to a request's `output_ids` (prefill, decode and the speculative verify all call it), so a
feature that changes what committing a token means (logprobs, hidden states, the finish check) changes
one function. The scan reads the syntax tree: `.output_ids.append/extend/insert(...)`,
`.output_ids += ...` and `.output_ids[...] = ...` count, on `output_ids` or `_output_ids`, directly or
through a local name bound to the list in the same function (`out = req.output_ids; out.append(t)`)."""

from __future__ import annotations

import ast
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")

SRT = Path(__file__).resolve().parents[3] / "python" / "sglang" / "srt"
NAMES = {"output_ids", "_output_ids"}
COMMIT = "managers/scheduler_components/batch_result_processor.py:BatchResultProcessor.commit"
ALLOWED = {
    COMMIT,
}


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
    assert COMMIT in found, "the scan finds commit's own append"
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
