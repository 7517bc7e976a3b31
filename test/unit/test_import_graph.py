"""The seams stay one-way across `sglang.srt`:
- no module imports `managers/scheduler.py` (helpers get what they use, explicitly), but the process
  launcher's entry that starts the scheduler process;
- no lower layer (the caches, sampling, grammars, configs, parsers, utilities, the server options) imports
  `entrypoints` or `model_executor` at run time (a `TYPE_CHECKING` import for a type hint is allowed);
- no import circle among the modules of `sglang.srt.managers`.
Every import counts (module level, `TYPE_CHECKING` blocks, imports inside functions) unless said otherwise.

By hand: `python test/unit/test_import_graph.py` prints the graph's edges and any circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")

SRC = Path(__file__).resolve().parents[2] / "python"
SRT = "sglang.srt"
PACKAGE = f"{SRT}.managers"
SCHEDULER = f"{PACKAGE}.scheduler"
# The one importer of the scheduler: the entry of the scheduler process (imported when it starts).
SCHEDULER_ENTRY = {f"{SRT}.entrypoints.process_launcher"}
LOWER_LAYERS = tuple(
    f"{SRT}.{name}"
    for name in (
        "mem_cache",
        "sampling",
        "constrained",
        "configs",
        "utils",
        "parser",
        "function_call",
        "environ",
        "server_args",
        "server_args_checks",
        "server_args_upstream",
        "server_args_upstream_table",
    )
)
UPPER_LAYERS = (f"{SRT}.entrypoints", f"{SRT}.model_executor")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _in(module: str, packages: tuple[str, ...] | set[str]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def imports_of(source: str | Path, known: set[str], run_time_only: bool = False) -> set[str]:
    """The known modules `source` (text or a file) imports (`from pkg import mod` counts as importing
    `pkg.mod`); `run_time_only`: not those under `if TYPE_CHECKING:`."""
    text = source.read_text() if isinstance(source, Path) else source
    out: set[str] = set()

    def visit(node: ast.AST) -> None:
        if run_time_only and isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(text))
    return out & known


def srt_sources() -> dict[str, Path]:
    return {module_name(p): p for p in (SRC / SRT.replace(".", "/")).rglob("*.py")}


def graph_of(sources: dict[str, str | Path], run_time_only: bool = False) -> dict[str, set[str]]:
    known = set(sources)
    return {mod: imports_of(src, known, run_time_only) - {mod} for mod, src in sources.items()}


def managers_graph() -> dict[str, set[str]]:
    return graph_of({m: p for m, p in srt_sources().items() if _in(m, (PACKAGE,))})


def scheduler_importers(sources: dict[str, str | Path]) -> list[str]:
    graph = graph_of({**sources, SCHEDULER: sources.get(SCHEDULER, "")})
    return sorted(m for m, deps in graph.items() if SCHEDULER in deps and m not in SCHEDULER_ENTRY)


def layer_violations(sources: dict[str, str | Path]) -> list[str]:
    graph = graph_of(sources, run_time_only=True)
    return sorted(
        f"{m} -> {d}"
        for m, deps in graph.items()
        if _in(m, LOWER_LAYERS)
        for d in deps
        if _in(d, UPPER_LAYERS)
    )


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


def test_no_module_of_srt_imports_the_scheduler():
    sources = srt_sources()
    assert len(sources) > 200 and f"{SRT}.disaggregation.decode" in sources, "the scan covers sglang.srt"
    importers = scheduler_importers(sources)
    assert importers == [], f"{importers} import {SCHEDULER}"


def test_no_lower_layer_imports_entrypoints_or_the_model_executor_at_run_time():
    violations = layer_violations(srt_sources())
    assert violations == [], f"lower layers import upper ones at run time: {violations}"


def test_a_planted_scheduler_import_in_a_helper_is_found():
    """The tests above fail on what they look for: a helper that imports the scheduler, even for a type
    hint only, and a cache module that imports the model executor inside a function."""
    sources: dict[str, str | Path] = dict(srt_sources())
    before, lower = set(scheduler_importers(sources)), set(layer_violations(sources))
    helper = f"{PACKAGE}.scheduler_components.planted_helper"
    sources[helper] = "from sglang.srt.managers.scheduler import Scheduler\n"
    assert set(scheduler_importers(sources)) - before == {helper}
    sources[helper] = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from sglang.srt.managers.scheduler import Scheduler\n"
    )
    assert set(scheduler_importers(sources)) - before == {helper}
    cache = f"{SRT}.mem_cache.planted"
    sources[cache] = "def f():\n    from sglang.srt.model_executor.forward_batch_info import ForwardBatch\n"
    assert set(layer_violations(sources)) - lower == {f"{cache} -> {SRT}.model_executor.forward_batch_info"}
    sources[cache] = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from sglang.srt.model_executor.forward_batch_info import ForwardBatch\n"
    )
    assert set(layer_violations(sources)) == lower


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


if __name__ == "__main__":
    graph = managers_graph()
    for mod in sorted(graph):
        print(mod, "->", ", ".join(sorted(graph[mod])) or "-")
    print("circle:", find_cycle(graph))
    print("scheduler importers:", scheduler_importers(srt_sources()))
    print("layer violations:", layer_violations(srt_sources()))
