"""Slot ids are host ints: the scheduler side (mem_cache/, managers/) never pulls a value off a device
tensor with .item(), .tolist() or .cpu(), each of which is a device sync on a GPU."""

from __future__ import annotations

import ast
from pathlib import Path

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")

SRT = Path(__file__).resolve().parents[3] / "python" / "sglang" / "srt"
CHECKED = ["mem_cache", "managers"]
SYNC_CALLS = {"item", "tolist", "cpu"}


def host_sync_calls(source: str, filename: str = "<src>") -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in SYNC_CALLS
        ):
            found.append(f"{filename}:{node.lineno}: .{node.func.attr}()")
    return found


def test_detector_finds_syncs():
    src = "a = t.item()\nb = x[0].tolist()\nc = y.cpu().numpy()\nd = z.sum()\n"
    assert [s.split(": ")[1] for s in host_sync_calls(src)] == [".item()", ".tolist()", ".cpu()"]


def test_scheduler_side_has_no_host_syncs():
    files = [p for d in CHECKED for p in sorted((SRT / d).rglob("*.py"))]
    assert len(files) > 5
    found = [hit for p in files for hit in host_sync_calls(p.read_text(), str(p.relative_to(SRT)))]
    assert not found, "device syncs on the scheduler side:\n" + "\n".join(found)
