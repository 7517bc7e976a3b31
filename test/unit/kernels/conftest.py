"""Fixtures shared by the kernel tests."""

from __future__ import annotations

import sys
import types

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


class _FlaModules:
    """Makes flash-linear-attention missing or importable (empty stand-in modules: the backend
    selection only imports it) for one test."""

    def __init__(self, monkeypatch):
        self.monkeypatch = monkeypatch

    def missing(self) -> None:
        for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
            self.monkeypatch.delitem(sys.modules, name)
        self.monkeypatch.setitem(sys.modules, "fla", None)  # `import fla...` raises ImportError

    def importable(self, submodule: str) -> None:
        parts = submodule.split(".")
        for i in range(1, len(parts) + 1):
            name = ".".join(parts[:i])
            self.monkeypatch.setitem(sys.modules, name, types.ModuleType(name))


@pytest.fixture
def fla_modules(monkeypatch) -> _FlaModules:
    return _FlaModules(monkeypatch)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
def kernel_device(request, monkeypatch) -> str:
    """Where a Triton kernel test runs: on CPU tensors under `TRITON_INTERPRET=1` (CI), and compiled on
    a CUDA GPU where there is one (marked `gpu`), against the same torch form."""
    if request.param == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return request.param


@pytest.fixture
def interpret(monkeypatch):
    """Triton kernels on CPU tensors run by the interpreter (tests that are CPU-only by design)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
