"""sgl-kernel's build step around torch's `cpp_extension.load`: a build stopped midway (its process killed)
leaves torch's `lock` file in the build folder, on which every later `load` would wait forever. The
builders take an flock first (released by the kernel when its holder dies), under which such a file is
a leftover and is removed; a live builder's lock is never touched. torch's `load` is replaced by a
stand-in that waits on `lock` as torch's does, with a deadline instead of forever."""

from __future__ import annotations

import fcntl
import os
import threading
import time
from types import ModuleType

import pytest
from torch.utils import cpp_extension

from sglang.srt.environ import envs
from sglang.srt.utils import sgl_kernel
from sglang.test.ci_register import register_cpu_ci

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
        return ModuleType(name)

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    with envs.SGLANG_CACHE_DIR.override(str(tmp_path)):
        out = sgl_kernel.build_dir() / "cpu"
        out.mkdir(parents=True)
        yield out, calls


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
