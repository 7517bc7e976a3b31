"""Our Triton kernels compiled for an H100 (sm_90) on a machine without a GPU, as CI checks them: that
each compiles at the real models' shapes, fits sm_90's shared memory per block, and keeps its values in
registers. A kernel that spills to local memory (`STACK` in the cubin's resource usage: bytes per
thread) compiles and runs, only slower, so nothing else here would show it: the MoE align kernel's
128 x 128 int64 tiles spilled 2,808 bytes per thread. The resource usage comes from `cuobjdump`, which
Triton's NVIDIA backend ships."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

# sm_90's largest shared memory per block (227 KiB): a kernel that asks for more compiles but fails at
# launch, so only a GPU run would show it.
SM90_MAX_SHARED = 232448


def compile_sm90(
    fn: Callable, signature: dict[str, str], constexprs: dict[str, Any], divisible: tuple[str, ...] = (), **options: Any
):
    """`fn` (a kernel's Python function, as `jit_for_env` takes it) compiled for sm_90 with `options`
    (num_warps, num_stages) as it is launched; pointer arguments 16-byte aligned, as Triton specialises
    them at launch on a GPU, and so the integer arguments named in `divisible` (multiples of 16 at the
    shapes checked, as Triton specialises them: without it a GEMM's rows are not known to be aligned,
    its loads are not vectorised and it spills). Checks the shared memory; returns Triton's compiled
    kernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    aligned = [i for i, (name, kind) in enumerate(signature.items()) if kind.startswith("*") or name in divisible]
    attrs = {(i,): [["tt.divisibility", 16]] for i in aligned}
    src = ASTSource(fn=JITFunction(fn), signature=signature, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options or None)
    assert ".target sm_90" in compiled.asm["ptx"]
    assert compiled.metadata.shared <= SM90_MAX_SHARED, f"{fn.__name__}: {compiled.metadata.shared} bytes"
    return compiled


def _cuobjdump() -> str | None:
    import triton.backends.nvidia

    bundled = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else shutil.which("cuobjdump")


def resource_usage(compiled) -> dict[str, int]:
    """Registers and local-memory bytes per thread of a compiled kernel: {"REG": .., "STACK": .., ...}."""
    tool = _cuobjdump()
    assert tool is not None, "cuobjdump is missing (Triton's NVIDIA backend ships one)"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        out = subprocess.run([tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if "REG:" in ln), None)
    assert line is not None, f"no resource usage in cuobjdump's output: {out.stdout}{out.stderr}"
    return {key: int(value) for key, value in re.findall(r"(\w+):(\d+)", line.split("Resource usage:")[-1])}


def compile_sm90_in_registers(
    fn: Callable, signature: dict, constexprs: dict, divisible: tuple[str, ...] = (), **options: Any
):
    """`compile_sm90`, and no spill to local memory (`STACK` 0)."""
    compiled = compile_sm90(fn, signature, constexprs, divisible, **options)
    usage = resource_usage(compiled)
    assert usage["STACK"] == 0, f"{fn.__name__} {constexprs} {options} spills: {usage}"
    return compiled
