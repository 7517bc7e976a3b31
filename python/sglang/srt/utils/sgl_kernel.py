"""sgl-kernel (`sgl-kernel/csrc/`), the project's native ops, as torch extensions: one C++/OpenMP extension
for CPU tensors (the state-copy ops and the linear-attention ops, `torch.ops.sgl_kernel.*`) and one CUDA
extension (the state-copy ops). One extension per device: a CPU source that fails to compile takes every
CPU op with it (each caller then runs its torch path). Both are built with `torch.utils.cpp_extension` on first
use and cached by content under `$SGLANG_CACHE_DIR/sgl-kernel/torch-VERSION/KIND/KEY/` (default
`~/.cache/sglang/...`), KEY being `build_key` (the sources, headers, flags and targets). `make run` / `make test`
build the CPU one at install time:

    python -m sglang.srt.utils.sgl_kernel [--cuda]

Keyed by content, identical sources in any checkout or virtual environment share one build: the sources are
copied into the build folder and compiled from there (torch's loader rebuilds whenever the sources' path
differs, so two checkouts built from their own paths rebuilt each other's build in turn), and a finished build
is loaded straight from its folder without asking torch's loader again. Different sources build in different
folders, so a build never waits behind another checkout's.

A build that fails (no compiler, no nvcc, a CPU-only torch for CUDA) is reported once per process and
the caller falls back to its torch implementation; `load_extension` never raises. Processes build or
load one folder at a time (an flock per build folder); a build that was killed midway is taken up by the
next process (`_builder_lock`), not waited for forever. Only the newest `KEEP_BUILDS` folders of a kind are
kept.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib.util
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
    "cpu": [
        "state_copy_cpu.cpp",
        "linear_attn_cpu.cpp",
        "attention_cpu.cpp",
        "moe_cpu.cpp",
        "moe_routing_cpu.cpp",
        "norm_cpu.cpp",
        "rope_cpu.cpp",
        "sampling_cpu.cpp",
        "decode_blocks_cpu.cpp",
    ],
    "cuda": ["state_copy_cuda_binding.cpp", "state_copy_cuda.cu"],
}
HEADERS = ["state_copy.h", "state_copy_binding.h", "cpu_math.h"]
FLOCK = "build.flock"  # held while a process builds or loads in a build folder
STAMP = "build.stamp"  # beside a finished build: its whole `build_key` (`is_built`)
KEY_CHARS = 16  # of `build_key` in a build folder's name
KEEP_BUILDS = 4  # build folders kept per kind: other checkouts' builds survive a few edits here

_loaded: dict[str, tuple[ModuleType | None, str]] = {}


def build_dir() -> Path:
    root = envs.SGLANG_CACHE_DIR.get() or os.path.join(Path.home(), ".cache", "sglang")
    return Path(root) / "sgl-kernel" / f"torch-{torch.__version__}"


def build_folder(kind: str, key: str | None = None) -> Path:
    """Where the build of `kind` from the sources as they are now (their `build_key`, computed unless
    given) lives: keyed by content, not path."""
    return build_dir() / kind / (key or build_key(kind))[:KEY_CHARS]


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

    key = build_key(kind)
    out = build_folder(kind, key)
    out.mkdir(parents=True, exist_ok=True)
    with _builder_lock(out):
        if _stamped(out, kind, key):
            return _load_built(kind, out)
        src = out / "src"
        src.mkdir(exist_ok=True)
        for name in SOURCES[kind] + HEADERS:
            shutil.copyfile(SOURCE_DIR / name, src / name)
        module = load(
            name=f"sgl_kernel_{kind}",
            sources=[str(src / f) for f in SOURCES[kind]],
            extra_include_paths=[str(src)],
            build_directory=str(out),
            verbose=verbose,
            **_flags(kind),
        )
        (out / STAMP).write_text(key)
    _prune(out.parent)
    return module


def _stamped(out: Path, kind: str, key: str) -> bool:
    try:
        return (out / f"sgl_kernel_{kind}.so").is_file() and (out / STAMP).read_text() == key
    except OSError:
        return False


def _load_built(kind: str, out: Path) -> ModuleType:
    """Imports a finished build's library as torch's loader would, without its rebuild check."""
    name = f"sgl_kernel_{kind}"
    spec = importlib.util.spec_from_file_location(name, out / f"{name}.so")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _prune(kind_dir: Path) -> None:
    """Removes all but the newest `KEEP_BUILDS` build folders; one whose flock is held (in use) stays."""
    folders = sorted((p for p in kind_dir.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    for old in folders[:-KEEP_BUILDS]:
        with contextlib.suppress(OSError), open(old / FLOCK, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _builder_lock(out: Path):
    """One process at a time builds or loads in `out`, under an flock that the kernel releases when its
    holder dies. torch's own lock (the file `lock`, which `load` creates and waits on while it exists)
    does not go away with a killed build, and every later load then waits forever: a server stopped
    during its first build would never start again. Under the flock, a `lock` file can only be such a
    leftover, and is removed. Closing the file releases the flock."""
    with open(out / FLOCK, "a") as f:
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
    if _missing_prerequisite(kind) is not None:
        return False
    key = build_key(kind)
    return _stamped(build_folder(kind, key), kind, key)


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
            print(f"sgl-kernel {kind} ops ready in {took:.1f} s ({build_folder(kind)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
