"""The scheduler's seams stay one-way: no import circle among the modules of `sglang.srt.managers`, and no
module there imports `scheduler.py` (helpers get what they use, explicitly). Every import counts: module
level, `TYPE_CHECKING` blocks and imports inside functions.

By hand: `python test/unit/test_import_graph.py` prints the graph's edges and any circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")

SRC = Path(__file__).resolve().parents[2] / "python"
PACKAGE = "sglang.srt.managers"
SCHEDULER = f"{PACKAGE}.scheduler"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The known modules `path` imports (`from pkg import mod` counts as importing `pkg.mod`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out & known


def managers_graph() -> dict[str, set[str]]:
    files = {module_name(p): p for p in (SRC / PACKAGE.replace(".", "/")).rglob("*.py")}
    known = set(files)
    return {mod: imports_of(path, known) - {mod} for mod, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(mod: str) -> list[str] | None:
        state[mod] = 1
        path.append(mod)
        for dep in sorted(graph.get(mod, ())):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        path.pop()
        state[mod] = 2
        return None

    for mod in sorted(graph):
        if mod not in state and (cycle := visit(mod)):
            return cycle
    return None


def test_no_import_circle_among_managers():
    graph = managers_graph()
    assert SCHEDULER in graph and graph[SCHEDULER], "the scan found the scheduler and what it imports"
    assert find_cycle(graph) is None, f"import circle: {' -> '.join(find_cycle(graph))}"


def test_no_manager_module_imports_the_scheduler():
    importers = sorted(mod for mod, deps in managers_graph().items() if SCHEDULER in deps)
    assert importers == [], f"{importers} import {SCHEDULER}"


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


if __name__ == "__main__":
    graph = managers_graph()
    for mod in sorted(graph):
        print(mod, "->", ", ".join(sorted(graph[mod])) or "-")
    print("circle:", find_cycle(graph))
