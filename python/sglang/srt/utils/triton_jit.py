"""What the project's Triton kernels share: jitting a kernel for the current `TRITON_INTERPRET` setting,
and a sum combine function for `tl.reduce`.

The interpreter (CPU tests) and the compiler need different objects: `triton.jit` decides which at the
time it runs, so each kernel is jitted at first use, once per setting. `tl.sum` (like `tl.zeros`) is a
jitted helper of triton.language that the interpreter refuses when triton.language was imported before
TRITON_INTERPRET was set (one pytest process); kernels reduce with `tl.reduce(x, axis, add)` instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import triton
from triton.runtime.jit import JITFunction


def _add_fn(a, b):
    return a + b


# A JITFunction whatever TRITON_INTERPRET says at import: compiled kernels need one, and the
# interpreter only calls its `.fn`.
add = JITFunction(_add_fn)

_jitted: dict[tuple[Callable, bool], object] = {}


def jit_for_env(fn: Callable):
    """`fn` jitted for the current `TRITON_INTERPRET` setting (cached per function and setting)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    key = (fn, interpret)
    if key not in _jitted:
        _jitted[key] = triton.jit(fn)
    return _jitted[key]
