"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.utils.sgl_kernel import load_extension


@pytest.fixture(scope="session")
def ops():
    """`torch.ops.sgl_kernel` with the CPU extension built (`make install` / `.ci/run` build it; a failed
    build is a test failure here, not a skip). The `SGLANG_CPU_*_BACKEND` choices are tested where they
    are made: each test file checks the module it exercises picked the op."""
    module, reason = load_extension("cpu")
    assert module is not None, f"the sgl-kernel CPU extension is not built: {reason}"
    return torch.ops.sgl_kernel
