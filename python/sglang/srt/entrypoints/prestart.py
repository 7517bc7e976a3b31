"""Children started before the server's flags are checked (`python -m sglang.launch_server` only), so that
their imports run while this process imports its own and checks the flags, not after.

A start used to be serial: this process imported its modules and checked the flags (2.2 s on a 2-core VM,
10.6 s on an H200's machine), then spawned the scheduler and the detokenizer, each of which imported torch,
transformers and the runtime again before it could load the model (~4 s on the VM). Here the launcher's
first lines spawn as many warm children as the command line's --tp-size / --dp-size / --nnodes ask for
(`children_for`), each of which imports those modules (`WARM_MODULES`) and then waits on its control pipe;
`process_launcher.start_subprocesses` hands each child of the start one of them (`take`): the name, the
entry function and its arguments go down the pipe, and the warm child runs the entry as a freshly spawned
one would, with the ready pipe it was given at its spawn. Where none is left (an Engine, a count the
command line did not say), children are spawned as before. Warm children the start did not use, and all
of them when the start fails before (a bad flag), are stopped (`release`, also at exit). Nothing the
children do depends on this process's state after its imports: the flags reach them with their
arguments, as they did, and no environment variable is set between the two moments.

This module imports nothing heavy: the launcher imports it before everything else.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import multiprocessing as mp
import multiprocessing.util  # noqa: F401 - its exit hook (joining the children) registers first: ours runs before it
import os
from typing import Any

# What each kind of child imports before it can run: a scheduler (every tensor-parallel rank), and the
# others (the detokenizer, the data-parallel controller), which need far less: on a machine of few cores
# the warm children share them with this process's own imports.
WARM_MODULES = {
    "scheduler": (
        "torch",
        "transformers",
        "sglang.srt.managers.scheduler",
        "sglang.srt.model_executor.model_runner",
    ),
    "other": ("sglang.srt.managers.detokenizer_manager", "sglang.srt.managers.data_parallel_controller"),
}


class Warm:
    """One warm child: its process, the pipe it takes its assignment from, and the reading end of the
    pipe it reports readiness on (its writing end went to the child at its spawn)."""

    def __init__(self, kind: str, proc: mp.process.BaseProcess, control: Any, reader: Any):
        self.kind, self.proc, self.control, self.reader = kind, proc, control, reader

    def assign(
        self, name: str, target: Any, args: tuple, rest: tuple = ()
    ) -> tuple[mp.process.BaseProcess, Any] | None:
        """Run `target(*args, ready_writer, *rest)` in the child (the launcher's child arguments:
        server_args and port_args, the ready pipe's writer, the rest); (its process, the ready reader),
        or None where the child is gone (it is then stopped, and the launcher spawns one). Anything else
        that fails here stops it too, and is raised."""
        try:
            self.control.send((name, target, args, rest))
        except OSError:  # (BrokenPipeError: it died while it imported)
            self.stop()
            return None
        except BaseException:
            self.stop()
            raise
        self.control.close()
        self.proc.name = f"sglang-{name}"
        return self.proc, self.reader

    def stop(self) -> None:
        self.control.close()
        self.reader.close()
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5.0)


_pool: list[Warm] = []
_registered = False  # (`release` at exit)


class _QuietParser(argparse.ArgumentParser):
    """Raises where argparse would print its usage and exit: the launcher's own parser reports a bad
    flag, in one sentence."""

    def error(self, message: str):
        raise ValueError(message)


def children_for(argv: list[str]) -> dict[str, int]:
    """The children a start with these flags runs on this node, by kind: its tensor-parallel ranks
    (times the data-parallel replicas), and on node 0 the detokenizer (and with data parallelism its
    controller). A command line this cannot read gives the plain start's; a wrong count costs nothing
    but time."""
    p = _QuietParser(add_help=False, allow_abbrev=False)
    p.add_argument("--tp-size", "--tp", "--tensor-parallel-size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    try:
        args, _ = p.parse_known_args(argv)
    except ValueError:  # (a malformed value: the real parser says so, once)
        return {"scheduler": 1, "other": 1}
    ranks = max(1, max(1, args.tp_size) * max(1, args.dp_size) // max(1, args.nnodes))
    if args.node_rank > 0:
        return {"scheduler": ranks, "other": 0}
    return {"scheduler": ranks, "other": 1 + (1 if args.dp_size > 1 else 0)}


def prestart(argv: list[str]) -> None:
    """Spawn the warm children a start with `argv` will use (none for --help, nor with
    SGLANG_PRESTART_CHILDREN=0: read here, before `environ` is imported)."""
    off = os.environ.get("SGLANG_PRESTART_CHILDREN", "1").strip().lower() in ("0", "false", "no", "off")
    if off or any(a in ("-h", "--help") for a in argv):
        return
    global _registered
    if not _registered:  # (before the first spawn: a start that fails half-way leaves none either; after
        # multiprocessing's own exit hook, which joins the children: atexit runs the last first)
        atexit.register(release)
        _registered = True
    ctx = mp.get_context("spawn")
    try:
        for kind, count in children_for(argv).items():
            for i in range(count):
                control_reader, control = ctx.Pipe(duplex=False)
                reader, writer = ctx.Pipe(duplex=False)
                args = (kind, control_reader, writer)
                proc = ctx.Process(target=warm_child, args=args, name=f"sglang-prestarted-{kind}-{i}")
                try:
                    proc.start()
                finally:
                    control_reader.close()
                    writer.close()
                _pool.append(Warm(kind, proc, control, reader))
    except BaseException:
        release()
        raise


def take(name: str) -> Warm | None:
    """A warm child for the start's child `name` ("scheduler", "scheduler tp1", "detokenizer", ...), or
    None (none of its kind left)."""
    kind = "scheduler" if name.startswith("scheduler") else "other"
    for i, warm in enumerate(_pool):
        if warm.kind == kind:
            return _pool.pop(i)
    return None


def release() -> None:
    """Stop the warm children no start took."""
    while _pool:
        _pool.pop().stop()


def warm_child(kind: str, control: Any, writer: Any) -> None:
    """A warm child: tied to its parent, it imports the `WARM_MODULES` of its kind, then runs what it is
    assigned, or exits where the parent closes the pipe first."""
    from sglang.srt.utils.child_process import exit_with_parent

    exit_with_parent("prestarted child")  # (the launcher's main thread started it)
    for name in WARM_MODULES[kind]:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - the assigned entry imports what it needs and reports its failure
            pass
    try:
        name, target, args, rest = control.recv()
    except (EOFError, OSError):
        os._exit(0)
    control.close()
    mp.current_process().name = f"sglang-{name}"
    target(*args, writer, *rest)
