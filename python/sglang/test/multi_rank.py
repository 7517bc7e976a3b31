"""Run a function on N gloo ranks (spawned processes on this machine) and collect what each returns:
the CPU test bed of tensor and expert parallelism. `fn(rank, world_size, init_method, *args)` must be
importable by name (defined in a module, not in a test file: spawn pickles it by its qualified name).
A rank that raises or dies fails the call at once with its message, never a wait for the timeout.
Return plain Python values (`.tolist()`, floats), never tensors: a tensor crosses the queue through shared
memory that its rank releases on exit, and the parent then waits on it until the timeout."""

from __future__ import annotations

import queue
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from sglang.test.test_utils import find_free_port


def _entry(fn: Callable, rank: int, world_size: int, init_method: str, args: tuple, results) -> None:
    import torch

    torch.set_num_threads(1)  # N ranks on two cores
    try:
        results.put((rank, True, fn(rank, world_size, init_method, *args)))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the test with it
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 300) -> list[Any]:
    """`fn`'s return value on each rank, in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    init_method = f"tcp://127.0.0.1:{find_free_port()}"
    procs = [
        ctx.Process(target=_entry, args=(fn, r, world_size, init_method, args, results), daemon=True)
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    got: dict[int, Any] = {}
    try:
        waited = 0.0
        while len(got) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                waited += 1.0
                dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0) and i not in got]
                if dead:
                    raise RuntimeError(
                        f"rank {dead[0]} died with exit code {procs[dead[0]].exitcode}"
                    ) from None
                if waited > timeout:
                    raise TimeoutError(
                        f"ranks {sorted(set(range(world_size)) - set(got))} gave no result"
                    ) from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            got[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return [got[r] for r in range(world_size)]
