"""SGLANG_LOG_TRITON_FIRST_USE (utils/triton_first_use.py): the hook Triton calls before compiling (or
loading from its disk cache) a specialization a process has not used yet logs the kernel's name, keeps
a hook already installed, lets Triton go on (returns None), and stays off unless asked. Triton is
called here with the keyword arguments its JITFunction passes (`_call_hook`): no GPU compiles on CI."""

from __future__ import annotations

import logging

import pytest

from sglang.srt.environ import envs
from sglang.srt.utils import triton_first_use as tfu
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")

triton = pytest.importorskip("triton")


def _call_as_triton_does(hook, name: str):
    from triton.runtime.jit import JitFunctionInfo

    return hook(
        key=("key",), repr=f"{name}[num_warps=4, num_ctas=1, num_stages=3](x_ptr: *fp32)",
        fn=JitFunctionInfo(tfu, name, None), compile={"key": ("key",)}, is_manual_warmup=False,
        already_compiled=False,
    )  # fmt: skip


def test_first_uses_are_logged_and_triton_goes_on(monkeypatch, caplog):
    runtime = triton.knobs.runtime
    seen = []
    monkeypatch.setattr(runtime, "jit_cache_hook", lambda **kw: seen.append(kw["fn"].name))
    with envs.SGLANG_LOG_TRITON_FIRST_USE.override(False):
        assert not tfu.install_if_asked()
    assert runtime.jit_cache_hook.__name__ == "<lambda>"  # (untouched)
    with envs.SGLANG_LOG_TRITON_FIRST_USE.override(True):
        assert tfu.install_if_asked()
    with caplog.at_level(logging.INFO, logger=tfu.__name__):
        assert _call_as_triton_does(runtime.jit_cache_hook, "_moe_gemm_kernel") is None
    assert [r.getMessage() for r in caplog.records] == ["Triton first use: _moe_gemm_kernel"]
    assert seen == ["_moe_gemm_kernel"]  # the hook that was there runs too
