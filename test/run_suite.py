"""Run a registered CI suite: `python test/run_suite.py --suite per-commit-cpu`.

Every `test_*.py` under test/ must declare itself with `register_cpu_ci(est_time=..., suite=...)`;
an undeclared file is an error, so no test is silently left out of CI. The selected files run in one
pytest process (fixtures such as the tiny presets and the oracle are shared).
"""

from __future__ import annotations

import argparse
import ast
import subprocess
import sys
import time
from pathlib import Path

TEST_ROOT = Path(__file__).resolve().parent


def registrations(path: Path) -> list[tuple[float, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "register_cpu_ci":
            kwargs = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
            args = [ast.literal_eval(a) for a in node.args]
            est = kwargs.get("est_time", args[0] if args else None)
            suite = kwargs.get("suite", args[1] if len(args) > 1 else "per-commit-cpu")
            found.append((float(est), suite))
    return found


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--suite", default="per-commit-cpu")
    parser.add_argument("--dry-run", action="store_true", help="List the files and estimated time only.")
    parser.add_argument("pytest_args", nargs="*", help="Extra arguments passed to pytest.")
    args = parser.parse_args()

    selected, unregistered = [], []
    for path in sorted(TEST_ROOT.rglob("test_*.py")):
        regs = registrations(path)
        if not regs:
            unregistered.append(path)
        selected += [(path, est) for est, suite in regs if suite == args.suite]
    if unregistered:
        for path in unregistered:
            print(f"error: {path.relative_to(TEST_ROOT)} does not call register_cpu_ci(...)", file=sys.stderr)
        return 2
    if not selected:
        print(f"error: no test file is registered for suite {args.suite!r}", file=sys.stderr)
        return 2
    total = sum(est for _, est in selected)
    print(f"suite {args.suite}: {len(selected)} files, estimated {total:.0f} s")
    for path, est in selected:
        print(f"  {est:6.0f} s  {path.relative_to(TEST_ROOT)}")
    if args.dry_run:
        return 0
    start = time.time()
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--durations=15"]
    cmd += [str(p) for p, _ in selected] + args.pytest_args
    rc = subprocess.call(cmd, cwd=TEST_ROOT.parent)
    print(f"suite {args.suite} finished in {time.time() - start:.0f} s with exit code {rc}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
