"""Float32 models on CUDA get IEEE dots in flash-linear-attention (layers/attention/fla_float32.py): the
Triton default and FLA's own TF32 constant, set before its kernels compile, never under a compiled one.
Checked on CPU with real `triton.jit` functions in a stand-in module (FLA itself needs a GPU to import)."""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest
import triton
import triton.language as tl

from sglang.srt.layers.attention import fla_float32
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

PRECISION = tl.constexpr("tf32")


@triton.jit
def _dot_kernel(a_ptr, out_ptr):
    r = tl.arange(0, 16)
    a = tl.load(a_ptr + r[:, None] * 16 + r[None, :])
    tl.store(out_ptr + r[:, None] * 16 + r[None, :], tl.dot(a, a, input_precision=PRECISION))


def _stand_in(name: str) -> types.ModuleType:
    """A module like FLA's chunk_fwd: a TF32 constant and an autotuned-looking kernel reading it."""
    module = types.ModuleType(name)
    kernel = triton.JITFunction(_dot_kernel.fn)
    kernel.__globals__ = module.__dict__  # the constant is looked up in this module, as in FLA's
    module.PRECISION = PRECISION
    module.wrapped = types.SimpleNamespace(fn=types.SimpleNamespace(fn=kernel))  # autotune(heuristics(jit))
    return module


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    name = "fla_stand_in_chunk_fwd"
    module = _stand_in(name)
    monkeypatch.setitem(sys.modules, name, module)
    yield module, ((name, "PRECISION"),)
    os.environ.pop("TRITON_F32_DEFAULT", None)  # set by the code under test, not by monkeypatch


def test_float32_dots_become_ieee_before_any_kernel_compiles(stand_in):
    module, constants = stand_in
    assert fla_float32.use_ieee_float32_dots(constants) == "ieee"
    assert os.environ["TRITON_F32_DEFAULT"] == "ieee"
    assert module.PRECISION == tl.constexpr("ieee")


def test_a_kernel_already_keyed_keeps_its_constant(stand_in, caplog):
    """Triton refuses every later launch of a kernel whose globals changed after it was keyed: a process
    that already ran FLA's float32 kernels keeps them as they are, with one warning."""
    module, constants = stand_in
    kernel = module.wrapped.fn.fn
    assert kernel.cache_key  # keys the kernel, as its first compile does
    with caplog.at_level(logging.WARNING, logger=fla_float32.__name__):
        assert fla_float32.use_ieee_float32_dots(constants) == "ieee"
    assert module.PRECISION == tl.constexpr("tf32")
    assert "already compiled" in caplog.text and "PRECISION" in caplog.text


def test_a_users_triton_f32_default_is_left_alone(stand_in, monkeypatch):
    module, constants = stand_in
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32")
    assert fla_float32.use_ieee_float32_dots(constants) == "user"
    assert os.environ["TRITON_F32_DEFAULT"] == "tf32" and module.PRECISION == tl.constexpr("tf32")


def test_a_users_ieee_default_reaches_flas_own_constant(stand_in, monkeypatch):
    module, constants = stand_in
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    assert fla_float32.use_ieee_float32_dots(constants) == "user"
    assert module.PRECISION == tl.constexpr("ieee")


def test_a_missing_constant_is_named_in_a_warning(stand_in, caplog):
    module, _ = stand_in
    with caplog.at_level(logging.WARNING, logger=fla_float32.__name__):
        assert fla_float32.use_ieee_float32_dots(((module.__name__, "RENAMED"),)) == "ieee"
    assert "has no RENAMED" in caplog.text


def test_without_fla_nothing_is_set(monkeypatch):
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert fla_float32.use_ieee_float32_dots((("no_such_fla_module.chunk_fwd", "X"),)) == "no-fla"
    assert "TRITON_F32_DEFAULT" not in os.environ
