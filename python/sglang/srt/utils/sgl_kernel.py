"""sgl-kernel (`sgl-kernel/csrc/`), the project's native ops, as torch extensions: one C++/OpenMP extension
for CPU tensors (the state-copy ops and the linear-attention ops, `torch.ops.sgl_kernel.*`) and one CUDA
extension (the state-copy ops). One extension per device: a CPU source that fails to compile takes every
CPU op with it (each caller then runs its torch path). Both are built with `torch.utils.cpp_extension` on first use and cached under
`$SGLANG_CACHE_DIR/sgl-kernel/` (default `~/.cache/sglang/sgl-kernel/`); later processes load the cached
build, and an edited source is rebuilt. `make run` / `make test` build the CPU one at install time:

    python -m sglang.srt.utils.sgl_kernel [--cuda]

A build that fails (no compiler, no nvcc, a CPU-only torch for CUDA) is reported once per process and
the caller falls back to its torch implementation; `load_extension` never raises. Processes build or
load one at a time (an flock per build folder); a build that was killed midway is taken up by the next
process (`_builder_lock`), not waited for forever.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from types import ModuleType

import torch

from sglang.srt.environ import envs

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parents[4] / "sgl-kernel" / "csrc"
SOURCES = {
    "cpu": ["state_copy_cpu.cpp", "linear_attn_cpu.cpp", "attention_cpu.cpp", "moe_cpu.cpp", "moe_routing_cpu.cpp", "norm_cpu.cpp", "rope_cpu.cpp", "sampling_cpu.cpp", "decode_blocks_cpu.cpp"],
    "cuda": ["state_copy_cuda_binding.cpp", "state_copy_cuda.cu"],
}
HEADERS = ["state_copy.h", "state_copy_binding.h", "cpu_math.h"]
STAMP = "build.stamp"  # beside a build: `build_key` of what it was built from (`is_built`)

_loaded: dict[str, tuple[ModuleType | None, str]] = {}


def build_dir() -> Path:
    root = envs.SGLANG_CACHE_DIR.get() or os.path.join(Path.home(), ".cache", "sglang")
    return Path(root) / "sgl-kernel" / f"torch-{torch.__version__}"


def _missing_prerequisite(kind: str) -> str | None:
    missing = [f for f in SOURCES[kind] + HEADERS if not (SOURCE_DIR / f).is_file()]
    if missing:
        return f"the sgl-kernel sources are not at {SOURCE_DIR} (an install without the repository checkout)"
    if kind == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        if torch.version.cuda is None:
            return "this torch has no CUDA"
        if CUDA_HOME is None or shutil.which("nvcc", path=os.path.join(CUDA_HOME, "bin")) is None:
            return "nvcc was not found (install the CUDA toolkit or set CUDA_HOME)"
    return None


def _ensure_ninja_on_path() -> None:
    """cpp_extension runs `ninja` from PATH; the pip package puts it beside this interpreter, which is
    not on PATH when the venv is not activated (`.venv/bin/python -m ...`)."""
    scripts = sysconfig.get_path("scripts")
    if shutil.which("ninja") is None and shutil.which("ninja", path=scripts) is not None:
        os.environ["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")


def _flags(kind: str) -> dict[str, list[str]]:
    # -fno-trapping-math lets GCC vectorise loops with clamps (linear_attn_cpu.cpp's exp); no -march: the
    # decode loops are short (head dims of 16-256) and measured slower with AVX-512 on the CI's EPYC.
    flags = {"extra_cflags": ["-O3", "-fno-trapping-math"]}
    if kind == "cpu":
        flags["extra_cflags"].append("-fopenmp")
        flags["extra_ldflags"] = ["-fopenmp"]
    else:
        flags["extra_cuda_cflags"] = ["-O3"]
    return flags


def build_key(kind: str) -> str:
    """What a build of `kind` depends on beyond torch's version (the folder's name): its sources and
    headers, the flags, and for CUDA the target architectures (TORCH_CUDA_ARCH_LIST, else the GPU's)
    and nvcc. torch's `load` rebuilds when any of these changed."""
    digest = hashlib.sha256(repr(sorted(_flags(kind).items())).encode())
    for name in SOURCES[kind] + HEADERS:
        digest.update(name.encode() + (SOURCE_DIR / name).read_bytes())
    if kind == "cuda":
        from torch.utils.cpp_extension import CUDA_HOME

        arch = os.environ.get("TORCH_CUDA_ARCH_LIST") or (
            str(torch.cuda.get_device_capability()) if torch.cuda.is_available() else ""
        )
        digest.update(f"{arch}|{CUDA_HOME}|{torch.version.cuda}".encode())
    return digest.hexdigest()


def _build(kind: str, verbose: bool) -> ModuleType:
    from torch.utils.cpp_extension import load

    _ensure_ninja_on_path()

    out = build_dir() / kind
    out.mkdir(parents=True, exist_ok=True)
    with _builder_lock(out):
        module = load(
            name=f"sgl_kernel_{kind}",
            sources=[str(SOURCE_DIR / f) for f in SOURCES[kind]],
            extra_include_paths=[str(SOURCE_DIR)],
            build_directory=str(out),
            verbose=verbose,
            **_flags(kind),
        )
        (out / STAMP).write_text(build_key(kind))
        return module


@contextlib.contextmanager
def _builder_lock(out: Path):
    """One process at a time builds or loads in `out`, under an flock that the kernel releases when its
    holder dies. torch's own lock (the file `lock`, which `load` creates and waits on while it exists)
    does not go away with a killed build, and every later load then waits forever: a server stopped
    during its first build would never start again. Under the flock, a `lock` file can only be such a
    leftover, and is removed. Closing the file releases the flock."""
    with open(out / "build.flock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        stale = out / "lock"
        if stale.exists():
            logger.warning("Removing %s, left by an sgl-kernel build that was stopped.", stale)
            stale.unlink(missing_ok=True)
        yield


def is_built(kind: str) -> bool:
    """Whether a build of `kind` is cached for what it would be built from now (`build_key`, stamped by
    `_build`): loading it then compiles nothing. Selections that must not pay a first build use it."""
    if kind in _loaded:
        return _loaded[kind][0] is not None
    out = build_dir() / kind
    if not (out / f"sgl_kernel_{kind}.so").is_file() or _missing_prerequisite(kind) is not None:
        return False
    try:
        return (out / STAMP).read_text() == build_key(kind)
    except OSError:
        return False


def load_extension(kind: str, verbose: bool = False) -> tuple[ModuleType | None, str]:
    """(module, "") or (None, why not). Built or loaded once per process; a failure warns once."""
    if kind not in _loaded:
        reason = _missing_prerequisite(kind)
        module = None
        if reason is None:
            try:
                module = _build(kind, verbose)
            except Exception as e:  # noqa: BLE001 - any build failure means: use another implementation
                tail = " | ".join([ln.strip() for ln in str(e).splitlines() if ln.strip()][-3:])
                reason = f"the build failed ({type(e).__name__}: ...{tail[-160:]})"
        if module is None:
            logger.warning(
                "sgl-kernel %s ops unavailable: %s. Falling back to the torch implementations "
                "(see sgl-kernel/README.md).",
                kind.upper(),
                reason,
            )
        _loaded[kind] = (module, reason or "")
    return _loaded[kind]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (or load the cached build of) the sgl-kernel ops.")
    parser.add_argument(
        "--cuda", action="store_true", help="Build the CUDA ops too (needs a CUDA torch and nvcc)."
    )
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for kind in ["cpu"] + (["cuda"] if args.cuda else []):
        start = time.time()
        # A failure has been logged as a warning by load_extension; the install goes on without the op.
        if load_extension(kind, verbose=args.verbose)[0] is not None:
            took = time.time() - start
            print(f"sgl-kernel {kind} ops ready in {took:.1f} s ({build_dir() / kind})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
