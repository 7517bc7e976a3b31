"""The IPC sockets of a server (`PortArgs`): one private folder holds them all, and nothing of them is
left in the temporary directory once the server is shut down or its PortArgs is dropped. (Each start
used to leave three placeholder files in /tmp whenever the launcher's shutdown did not run: 116 of each
after a day of test runs.)"""

from __future__ import annotations

import gc
import os
import stat
import subprocess
import sys
import tempfile

import zmq

from sglang.srt.entrypoints.process_launcher import LaunchedProcesses
from sglang.srt.managers.io_struct import PortArgs
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")


def _paths(ports: PortArgs) -> list[str]:
    names = [ports.tokenizer_ipc_name, ports.scheduler_input_ipc_name, ports.detokenizer_ipc_name]
    return [name.removeprefix("ipc://") for name in names + [ports.ipc_name("dp0")]]


def test_the_sockets_share_one_private_folder_that_goes_with_its_port_args(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ports = PortArgs.init_new()
    folder = ports.ipc_dir
    assert {os.path.dirname(p) for p in _paths(ports)} == {folder} and len(set(_paths(ports))) == 4
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700  # (no other user reaches the sockets)
    assert os.listdir(folder) == []  # no placeholder files: the sockets appear as they are bound
    del ports
    gc.collect()
    assert list(tmp_path.iterdir()) == []


def test_shutdown_removes_the_bound_sockets_and_their_folder(monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ports = PortArgs.init_new()
    ctx = zmq.Context()
    sockets = [ctx.socket(zmq.PULL) for _ in range(2)]
    try:
        sockets[0].bind(ports.tokenizer_ipc_name)
        sockets[1].bind(ports.ipc_name("dp-replies"))
        assert sorted(os.listdir(ports.ipc_dir)) == ["dp-replies", "tokenizer"]
        LaunchedProcesses(ports, {}).shutdown()
        assert list(tmp_path.iterdir()) == []
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()


def test_a_forked_child_that_exits_leaves_the_folder_to_its_parent(tmp_path):
    """The removal hook is inherited by a child forked from the server's process (a script around an
    Engine that forks a worker): its normal exit must not remove the sockets the server still serves."""
    code = (
        "import os, sys, tempfile\n"
        f"tempfile.tempdir = {str(tmp_path)!r}\n"
        "from sglang.srt.managers.io_struct import PortArgs\n"
        "ports = PortArgs.init_new()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    sys.exit(0)  # (a normal exit: the exit hooks run)\n"
        "os.waitpid(pid, 0)\n"
        "assert os.path.isdir(ports.ipc_dir), 'the child removed the folder'\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert list(tmp_path.iterdir()) == []  # (and the parent's own exit removed it)
