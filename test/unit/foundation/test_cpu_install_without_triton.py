"""The CPU path serves without triton installed (it comes with the `test` extra and with CUDA builds of
torch, not with a plain `pip install -e .`): the Triton kernel modules are imported only where a layer
runs them. Checked in a subprocess where importing triton fails."""

from __future__ import annotations

import subprocess
import sys

from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=15, suite="per-commit-cpu")

SCRIPT = """
import sys
sys.modules["triton"] = None  # `import triton` now raises ImportError, as where it is not installed
from sglang.test.model_checks import make_runner, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver
for preset in ("tiny-qwen3-next", "tiny-nemotron-h"):
    runner = make_runner(preset, mamba_scheduler_strategy="extra_buffer")
    driver = RunnerDriver(runner)
    req = driver.new_request()
    driver.extend([Extend(req, random_ids(40, seed=1))])
    driver.decode([req])
print("served")
"""


def test_the_cpu_path_serves_without_triton():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "served" in proc.stdout, proc.stderr[-3000:]
