"""Two extensions with the state-copy binding load in one process (nightly: the second module's build, ~22 s
on 2 cores from a fresh checkout, was the slowest call of the per-commit suite). On a GPU machine one
process loads the CPU and the CUDA extension, and both register a StateTable: pybind11 refused the second
("already registered": the CUDA ops were unavailable on the H200). Run it with
`.venv/bin/python test/run_suite.py --suite nightly-cpu` (or this file alone)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from sglang.srt.utils import sgl_kernel
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=30, suite="nightly-cpu")

_TWIN_SCRIPT = """
import sys, torch
from torch.utils.cpp_extension import load
from sglang.srt.utils import sgl_kernel
real, why = sgl_kernel.load_extension("cpu")
assert real is not None, why
twin = load(name="sgl_kernel_state_copy_twin", sources=[str(sgl_kernel.SOURCE_DIR / "state_copy_cpu.cpp")],
            extra_cflags=["-O0", "-fopenmp"], extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(sgl_kernel.SOURCE_DIR)], build_directory=sys.argv[1])
assert real.StateTable is not twin.StateTable
print("both loaded")
"""


def test_two_extensions_with_the_state_copy_binding_load_in_one_process():
    """A second CPU module built from the same binding stands in for the CUDA one (built beside the real
    ops, then reused while its sources and their path are unchanged)."""
    if sgl_kernel.load_extension("cpu")[0] is None:
        pytest.skip("the sgl-kernel CPU ops are not built here")
    build = sgl_kernel.build_dir() / "state_copy_twin"
    build.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-c", _TWIN_SCRIPT, str(build)], capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0 and "both loaded" in proc.stdout, proc.stderr[-2000:]
