"""IEEE float32 dots in flash-linear-attention's kernels for float32 models on CUDA.

FLA's Triton dots run float32 inputs in TF32 (Triton's default on Ampere and later, plus one module
constant naming TF32 in Gated DeltaNet's fused triangular solve). Measured on an H200 over the strategy
matrix's workloads (`benchmark/gpu/oracle_drift.py`, tiny-qwen3-next in float32): TF32 moved logprobs by
up to 0.24 from the float32 transformers oracle; IEEE dots gave 7.7e-6, as the torch form on the GPU
(8.8e-6) and the CPU path do. A float32 model is asked for to be exact, as torch's own float32 matmuls
are by default, so float32 on CUDA gets IEEE. The setting is the process's (an environment variable and
a module constant), as is the model's dtype in a serving process; a process that later runs a bfloat16
model keeps it, for FLA's float32 intermediates (its bfloat16 dots are unaffected).
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

# FLA's module that names its dot precision itself instead of leaving it to Triton's default.
_TF32_CONSTANTS = (("fla.ops.gated_delta_rule.chunk_fwd", "SOLVE_TRIL_DOT_PRECISION"),)


def _jit_functions(module: ModuleType):
    """The `triton.jit` functions of a module, through autotune / heuristics wrappers."""
    from triton.runtime.jit import JITFunction

    for value in vars(module).values():
        while value is not None and not isinstance(value, JITFunction) and hasattr(value, "fn"):
            value = value.fn
        if isinstance(value, JITFunction):
            yield value


def set_ieee(module: ModuleType, constant: str) -> bool:
    """Point `module.constant` at IEEE unless one of its kernels was already hashed (compiled or
    keyed): Triton then refuses every later launch of it whose globals changed, so it stays as it is."""
    import triton.language as tl

    if not hasattr(module, constant):
        logger.warning("%s has no %s: its float32 dots keep their own precision.", module.__name__, constant)
        return False
    if any(fn.hash is not None for fn in _jit_functions(module)):
        logger.warning(
            "%s already compiled its kernels with %s=%s in this process; they stay so.",
            module.__name__, constant, getattr(module, constant),
        )  # fmt: skip
        return False
    setattr(module, constant, tl.constexpr("ieee"))
    return True


def use_ieee_float32_dots(constants=_TF32_CONSTANTS) -> str:
    """Make FLA's float32 dots IEEE in this process, before its kernels compile. Returns what was done:
    "user" (TRITON_F32_DEFAULT was set: it is left as it is, and where it says ieee FLA's own constant
    follows it), "no-fla", or "ieee"."""
    user = os.environ.get("TRITON_F32_DEFAULT")
    if user and user != "ieee":
        return "user"
    modules = []
    for name, constant in constants:
        try:
            modules.append((importlib.import_module(name), constant))
        except Exception:  # noqa: BLE001 - no usable FLA: nothing of it runs
            return "no-fla"
    # Triton reads the default at each compile (and keys its disk cache by it).
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    for module, constant in modules:
        set_ieee(module, constant)
    if user:
        return "user"
    logger.info("Float32 model on CUDA: flash-linear-attention's float32 dots run in IEEE, not TF32.")
    return "ieee"
