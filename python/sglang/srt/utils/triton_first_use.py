"""SGLANG_LOG_TRITON_FIRST_USE=1: every Triton kernel specialization a process uses for the first time is
logged ("Triton first use: NAME"), whether it compiles or loads from Triton's disk cache; both cost
(tens of milliseconds to seconds) and only the compiles leave new files behind. Issue 55 asks that
nothing be paid after a server is ready: on an H200 (2026-11-30) no kernel compiled after ready, yet the
first `bench_serving` run reached 0.784x the second's throughput, with a disk cache warm from an earlier
benchmark in the same call; `benchmark/bench_server_startup.py` counts these lines after ready.

Triton calls `knobs.runtime.jit_cache_hook` before each compile of a specialization the process's
in-memory cache lacks (a disk-cache hit goes through the same compile call); the hook returns None, so
Triton goes on as without it. Where the installed Triton has no such hook, one warning says so."""

from __future__ import annotations

import logging
from typing import Any

from sglang.srt.environ import envs

logger = logging.getLogger(__name__)

MESSAGE = "Triton first use: %s"


def _log_first_use(**kwargs: Any) -> None:
    # (`fn` is Triton's JitFunctionInfo(module, name, jit_function); `repr` names the specialization)
    try:
        name = getattr(kwargs.get("fn"), "name", None) or str(kwargs.get("repr", "?")).split("[", 1)[0]
        logger.info(MESSAGE, name)
    except Exception:  # noqa: BLE001 - a log line must never stop a compile
        logger.info(MESSAGE, "?")


def install_if_asked() -> bool:
    """Installs the logging hook where SGLANG_LOG_TRITON_FIRST_USE asks (keeping any hook already set,
    which it calls after logging, with Triton's arguments as they came); whether it is installed."""
    if not envs.SGLANG_LOG_TRITON_FIRST_USE.get():
        return False
    try:
        import triton
    except ImportError:
        return False
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_cache_hook"):
        logger.warning("SGLANG_LOG_TRITON_FIRST_USE: this Triton (%s) has no jit_cache_hook.", triton.__version__)
        return False
    previous = runtime.jit_cache_hook

    def hook(*args: Any, **kwargs: Any) -> Any:
        _log_first_use(**kwargs)
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_cache_hook = hook
    return True
