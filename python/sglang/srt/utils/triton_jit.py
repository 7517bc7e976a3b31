"""What the project's Triton kernels share: jitting a kernel for the current `TRITON_INTERPRET` setting,
and the sum and max combine functions for `tl.reduce`.

The interpreter (CPU tests) and the compiler need different objects: `triton.jit` decides which at the
time it runs, so each kernel is jitted at first use, once per setting. `tl.sum` (like `tl.zeros`) is a
jitted helper of triton.language that the interpreter refuses when triton.language was imported before
TRITON_INTERPRET was set (one pytest process); kernels reduce with `tl.reduce(x, axis, add)` (and
`tl.reduce(x, axis, maximum)` for `tl.max`) instead.
"""

from __future__ import annotations

import os
import types
from collections.abc import Callable

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


def _add_fn(a, b):
    return a + b


def _maximum_fn(a, b):
    return tl.maximum(a, b)


# JITFunctions whatever TRITON_INTERPRET says at import: compiled kernels need them.
add = JITFunction(_add_fn)
maximum = JITFunction(_maximum_fn)

# Under the interpreter a kernel sees triton.language's own combine functions instead, which the
# interpreter recognises by identity and reduces with numpy; any other combine function it calls once
# per element (far slower). Only their identity matters there: they are never called.
_INTERPRETED_COMBINES = {
    "add": getattr(tl.standard, "_sum_combine", add),
    "maximum": getattr(tl.standard, "_elementwise_max", maximum),
}

_jitted: dict[tuple[Callable, bool], object] = {}


def jit_for_env(fn: Callable):
    """`fn` jitted for the current `TRITON_INTERPRET` setting (cached per function and setting)."""
    interpret = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    key = (fn, interpret)
    if key not in _jitted:
        if interpret:
            scope = {**fn.__globals__}
            scope.update({k: v for k, v in _INTERPRETED_COMBINES.items() if scope.get(k) is globals()[k]})
            # A jitted helper the kernel calls (jitted at import, for the compiler) runs interpreted too:
            # the interpreter refuses to call a compiler's JITFunction.
            scope.update({
                k: jit_for_env(scope[k].fn) for k in fn.__code__.co_names
                if isinstance(scope.get(k), JITFunction) and k not in _INTERPRETED_COMBINES
            })  # fmt: skip
            fn = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
        _jitted[key] = triton.jit(fn)
    return _jitted[key]
