"""The IPC endpoints of a server's processes (`PortArgs`, SGLang's name), in one private folder."""

from __future__ import annotations

import os
import shutil
import tempfile
import weakref
from dataclasses import dataclass


def _remove_if_owner(folder: str, owner: int) -> None:
    if os.getpid() == owner:
        shutil.rmtree(folder, ignore_errors=True)


@dataclass
class PortArgs:
    """IPC endpoints (ZMQ `ipc://` names) of the three processes, in one private folder (`ipc_dir`, mode
    0700) that also holds the data-parallel controller's (`ipc_name`). The folder goes with its sockets:
    at `remove_ipc_dir` (the launcher's shutdown), or when the PortArgs that made it is collected or this
    process exits (a tokenizer manager some test or tool never shut down)."""

    tokenizer_ipc_name: str
    scheduler_input_ipc_name: str
    detokenizer_ipc_name: str
    ipc_dir: str = ""

    @classmethod
    def init_new(cls) -> PortArgs:
        folder = tempfile.mkdtemp(prefix="sglang-ipc-")
        names = (f"ipc://{os.path.join(folder, tag)}" for tag in ("tokenizer", "scheduler", "detokenizer"))
        made = cls(*names, ipc_dir=folder)
        # (Not pickled: the children's copies remove nothing; this process's copy, which outlives them. A
        # child forked from this process inherits the hook: it removes nothing either.)
        weakref.finalize(made, _remove_if_owner, folder, os.getpid())
        return made

    def ipc_name(self, tag: str) -> str:
        """Another socket of this server's (the data-parallel controller's), in the same folder."""
        if not self.ipc_dir:
            raise ValueError("this PortArgs has no IPC folder (made by PortArgs.init_new)")
        return f"ipc://{os.path.join(self.ipc_dir, tag)}"

    def remove_ipc_dir(self) -> None:
        """Remove the folder and every socket in it (once the processes bound to them are gone)."""
        if self.ipc_dir:
            shutil.rmtree(self.ipc_dir, ignore_errors=True)
