"""sgl-kernel's build step around torch's `cpp_extension.load`: a build stopped midway (its process killed)
leaves torch's `lock` file in the build folder, on which every later `load` would wait forever. The
builders take an flock first (released by the kernel when its holder dies), under which such a file is
a leftover and is removed; a live builder's lock is never touched. Builds are keyed by content: two
checkouts of the same sources share one build and never rebuild each other's, and different sources never
wait behind each other. torch's `load` is replaced by a stand-in that waits on `lock` as torch's does, with a
deadline instead of forever, and leaves a library file as a build would."""

from __future__ import annotations

import fcntl
import os
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
from torch.utils import cpp_extension

from sglang.srt.environ import envs
from sglang.srt.utils import sgl_kernel
from sglang.test.ci_register import register_cpu_ci

SOURCES = sgl_kernel.SOURCE_DIR

register_cpu_ci(est_time=3, suite="per-commit-cpu")

# How long the stand-in waits for `lock` to go before failing the test (torch's `load` waits forever).
WAIT_S = 2.0


@pytest.fixture
def build(monkeypatch, tmp_path):
    """Builds into tmp_path with a stand-in `load`; yields the CPU build folder."""
    calls = []

    def fake_load(name, build_directory, **kwargs):
        lock = f"{build_directory}/lock"
        deadline = time.monotonic() + WAIT_S
        while os.path.exists(lock):  # torch's FileBaton.wait: poll until it is gone
            if time.monotonic() > deadline:
                raise TimeoutError(f"{lock} never went away")
            time.sleep(0.01)
        calls.append(name)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")
        return ModuleType(name)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    # A finished build is imported from its folder; the stand-in library is a marker, not a real one.
    monkeypatch.setattr(sgl_kernel, "_load_built", lambda kind, out: ModuleType(f"cached:{out.name}"))
    with envs.SGLANG_CACHE_DIR.override(str(tmp_path / "cache")):
        out = sgl_kernel.build_folder("cpu")
        out.mkdir(parents=True)
        yield out, calls


def checkout(tmp_path: Path, name: str, monkeypatch, edit: bool = False) -> Path:
    """A copy of the sgl-kernel sources at another path (another checkout), used from now on."""
    src = tmp_path / name / "csrc"
    if not src.exists():
        shutil.copytree(SOURCES, src)
    if edit:
        with open(src / sgl_kernel.HEADERS[0], "a") as f:
            f.write(f"\n// edited in {name}\n")
    monkeypatch.setattr(sgl_kernel, "SOURCE_DIR", src)
    return src


def test_a_lock_left_by_a_stopped_build_is_removed(build, caplog):
    out, calls = build
    (out / "lock").touch()
    module = sgl_kernel._build("cpu", verbose=False)
    assert module.__name__ == "sgl_kernel_cpu" and calls == ["sgl_kernel_cpu"]
    assert not (out / "lock").exists()
    assert any("left by an sgl-kernel build that was stopped" in r.getMessage() for r in caplog.records)


def test_a_live_builders_lock_is_waited_for_not_removed(build):
    """While another builder holds the flock, its `lock` stays; this build goes on once it is done."""
    out, calls = build
    with open(out / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (out / "lock").touch()
        done = []
        waiter = threading.Thread(target=lambda: done.append(sgl_kernel._build("cpu", verbose=False)))
        waiter.start()
        time.sleep(0.5)
        assert (out / "lock").exists() and done == [] and calls == []
        (out / "lock").unlink()  # the live builder finishes: torch removes its lock, then the flock goes
        fcntl.flock(held, fcntl.LOCK_UN)
    waiter.join(10)
    assert len(done) == 1 and calls == ["sgl_kernel_cpu"]


def test_identical_sources_in_two_checkouts_share_one_build(build, tmp_path, monkeypatch):
    """A development tree and CI's clone (or two virtual environments): the second loads the first's build
    as it is. Built from their own paths, torch's loader rebuilt whenever the other had built last."""
    _, calls = build
    checkout(tmp_path, "dev", monkeypatch)
    first = sgl_kernel._build("cpu", verbose=False)
    ci_clone = checkout(tmp_path, "ci", monkeypatch)
    second = sgl_kernel._build("cpu", verbose=False)
    assert calls == ["sgl_kernel_cpu"], "the second checkout compiled the same sources again"
    assert first.__name__ == "sgl_kernel_cpu" and second.__name__.startswith("cached:")
    assert sgl_kernel.is_built("cpu")
    # The build never names a checkout's path: it compiled copies kept in its own folder.
    built_from = sgl_kernel.build_folder("cpu") / "src"
    assert sorted(p.name for p in built_from.iterdir()) == sorted(
        sgl_kernel.SOURCES["cpu"] + sgl_kernel.HEADERS
    )
    assert str(ci_clone) not in str(sgl_kernel.build_folder("cpu"))


def test_other_sources_do_not_wait_behind_a_running_build(build, tmp_path, monkeypatch):
    """An edited checkout builds in a folder of its own while the other checkout's build holds its folder."""
    out, calls = build
    checkout(tmp_path, "dev", monkeypatch)
    running = sgl_kernel.build_folder("cpu")
    running.mkdir(parents=True, exist_ok=True)
    with open(running / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the dev tree's build is running
        checkout(tmp_path, "edited", monkeypatch, edit=True)
        assert sgl_kernel.build_folder("cpu") != running
        done = []
        builder = threading.Thread(target=lambda: done.append(sgl_kernel._build("cpu", verbose=False)))
        builder.start()
        builder.join(WAIT_S)
        assert len(done) == 1, "the edited sources waited for another checkout's build"
    assert calls == ["sgl_kernel_cpu"]


def test_old_builds_are_pruned_but_not_one_in_use(build, tmp_path, monkeypatch):
    out, _ = build
    kind_dir = out.parent
    old = [kind_dir / f"old{i}" for i in range(sgl_kernel.KEEP_BUILDS + 2)]
    for i, folder in enumerate(old):
        folder.mkdir()
        (folder / "build.flock").touch()  # as a build leaves it (creating it would make the folder new)
        os.utime(folder, (i + 10, i + 10))  # old[i] is the i-th oldest build
    os.utime(out, (1, 1))  # the fixture's empty folder: the oldest of all
    with open(old[0] / "build.flock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # a process is loading the oldest build
        checkout(tmp_path, "newest", monkeypatch, edit=True)
        sgl_kernel._build("cpu", verbose=False)
    kept = {p for p in kind_dir.iterdir() if p.is_dir()}
    newest = sgl_kernel.build_folder("cpu")
    assert kept == {old[0], *old[-(sgl_kernel.KEEP_BUILDS - 1) :], newest}, "a build in use was removed"
