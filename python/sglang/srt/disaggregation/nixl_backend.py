"""`--disaggregation-transfer-backend nixl`: the KV and state bytes move through NIXL (its UCX backend)
instead of Mooncake; everything else (destinations, answers, staging) is the same.

Measured on CPU (reference/distributed.md, section 2, and this module's test): NIXL 1.5.1 (`nixl-cu12`
or `nixl-cu13` from PyPI; the `nixl` meta package installs both) instantiates its UCX backend without a
GPU and moves host memory between two processes (UCX picks `cma`, process_vm_writev, on one machine; TCP
across machines). Each agent runs without NIXL's progress thread, which spins a whole core while idle:
the writer polls its transfer until done, and the receiving side (the decode server, which never
initiates) runs `PROGRESS_INTERVAL_S` polls on a thread of its own, without which a write lands but is
never reported done.

A server's session id is its agent's metadata (which names its registered memory and its UCX
addresses), base64 in the destination; the prefill server adds a decode server's agent on the first
destination from it. Like Mooncake's ports, UCX's listeners take any peer's connection: the transfer
network must be isolated (docs/disaggregation.md, "Network and trust").
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import logging
import os
import threading
import time
import uuid
from pathlib import Path

from sglang.srt.disaggregation.transfer import TransferError, listening_sockets
from sglang.srt.server_args import ServerArgsError

logger = logging.getLogger(__name__)

# The import names of NIXL's Python API: the `nixl` meta package's, or either build's own.
NIXL_MODULES = ("nixl", "nixl_cu12", "nixl_cu13")
# The receiving side's poll: a write is reported done within about this long after it landed.
PROGRESS_INTERVAL_S = 0.001
# A write not done after this long failed (64 MiB took ~0.1 s on a loaded 2-core machine).
WRITE_TIMEOUT_S = 60.0
# Remote agents kept added at once (the least recently used is removed past this).
MAX_REMOTE_AGENTS = 64


def exclude_absent_efa() -> None:
    """Leave UCX's EFA module unloaded where the machine has no EFA device (unless UCX_MODULES is set):
    loaded on a machine without one (any with libibverbs but no AWS EFA adapter), it crashes the process
    at exit (SIGSEGV in its teardown, after everything ran). The InfiniBand / RoCE modules stay."""
    if "UCX_MODULES" in os.environ:
        return
    devices = Path("/sys/class/infiniband")
    drivers = {(d / "device" / "driver").resolve().name for d in devices.iterdir()} if devices.is_dir() else set()
    if "efa" not in drivers:
        os.environ["UCX_MODULES"] = "^efa"


def nixl_module() -> str | None:
    """The importable NIXL package, or None."""
    return next((m for m in NIXL_MODULES if importlib.util.find_spec(m) is not None), None)


class NixlTransferEngine:
    """One NIXL agent per server: its buffers registered once, writes to a peer by session id (the
    peer agent's metadata). `progress`: this server receives writes (the decode side)."""

    def __init__(self, hostname: str, regions: list[tuple[int, int]], progress: bool):
        module = nixl_module()
        if module is None:
            raise ServerArgsError(
                "--disaggregation-transfer-backend nixl needs NIXL: pip install 'sglang[nixl]' (nixl-cu12)."
            )
        api = importlib.import_module(f"{module}._api")
        exclude_absent_efa()
        self.name = f"sglang-{hostname}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        before = listening_sockets()
        self.agent = api.nixl_agent(self.name, config)
        self.listening = sorted(listening_sockets() - before)
        if self.listening:
            logger.warning(
                "NIXL's UCX listens on %s and lets any peer that reaches it write the registered KV and "
                "state buffers: keep these ports on an isolated network (docs/disaggregation.md).",
                ", ".join(self.listening),
            )
        regions = [(p, n) for p, n in regions if n > 0]
        if regions:
            self.agent.register_memory([(p, n, 0, "") for p, n in regions], "DRAM")
        self.session_id = base64.b64encode(self.agent.get_agent_metadata()).decode()
        self.remote: dict[str, str] = {}  # session id -> agent name, least recently used first
        self.active: list = []  # handles of writes given up while still running (released once ended)
        self._stop = threading.Event()
        self._thread = None
        if progress:
            self._thread = threading.Thread(target=self._progress, name="nixl-progress", daemon=True)
            self._thread.start()
        logger.info("NIXL agent %s up (%s, UCX): %d buffers registered.", self.name, module, len(regions))

    def _progress(self) -> None:
        while not self._stop.wait(PROGRESS_INTERVAL_S):
            self.agent.get_new_notifs()

    def _peer(self, session_id: str) -> str:
        name = self.remote.pop(session_id, None)
        if name is None:
            if len(self.remote) >= MAX_REMOTE_AGENTS:
                self.agent.remove_remote_agent(self.remote.pop(next(iter(self.remote))))
            try:
                metadata = base64.b64decode(session_id, validate=True)
            except ValueError as e:
                raise TransferError(f"the session id is not a NIXL agent's metadata ({e})") from None
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
        self.remote[session_id] = name
        return name

    def write(self, session_id: str, descriptors: list[tuple[int, int, int]]) -> None:
        """Write each (local address, remote address, bytes) into the peer's registered memory, as one
        transfer; returns when it is done."""
        if not descriptors:
            return
        self._reap()
        peer = self._peer(session_id)
        local = self.agent.get_xfer_descs([(s, n, 0) for s, _, n in descriptors], "DRAM")
        remote = self.agent.get_xfer_descs([(d, n, 0) for _, d, n in descriptors], "DRAM")
        handle = self.agent.initialize_xfer("WRITE", local, remote, peer)
        state = "PROC"
        try:
            state = self.agent.transfer(handle)
            deadline = time.monotonic() + WRITE_TIMEOUT_S
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL write of {len(descriptors)} blocks to {peer} not done in "
                                        f"{WRITE_TIMEOUT_S:g} s")  # fmt: skip
                time.sleep(0.0001)  # (the receiver's progress poll reports it within a millisecond)
                state = self.agent.check_xfer_state(handle)
            if state == "ERR":
                raise TransferError(f"NIXL write of {len(descriptors)} blocks to {peer} failed.")
        finally:  # (releasing a running write may raise, which would replace the error being raised)
            if state in ("DONE", "ERR"):
                self._release(handle)
            else:
                self.active.append(handle)

    def _reap(self) -> None:
        """Release the handles of writes given up earlier that have ended since."""
        running = []
        for handle in self.active:
            try:
                ended = self.agent.check_xfer_state(handle) != "PROC"
            except Exception:  # noqa: BLE001 - a handle NIXL no longer knows: nothing to wait for
                ended = True
            if ended:
                self._release(handle)
            else:
                running.append(handle)
        self.active = running

    def _release(self, handle) -> None:
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as e:  # noqa: BLE001 - a leaked handle, not a failed request
            logger.warning("NIXL: a transfer handle could not be released (%s).", e)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
