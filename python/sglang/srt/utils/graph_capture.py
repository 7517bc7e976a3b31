"""Whether the forward running now is a CUDA graph's body, its warm-up or its capture
(`cuda_graph_runner.capture_graph` marks both with `graph_body`): the few choices that differ between a
replayed graph and an eager call (fewer launches save host time, which a replay does not spend) ask
`in_graph_body`, so that the warm-up runs, and so loads, the kernels the capture records (a Triton
kernel's first launch inside a capture can fail: its module loads then). Per thread, as captures are:
a recapture may run beside another thread's eager forward."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_state = threading.local()


@contextlib.contextmanager
def graph_body() -> Iterator[None]:
    """The forwards run inside are a graph's body (its warm-up and capture; the kernel census's eager run
    of a body)."""
    outer = getattr(_state, "on", False)
    _state.on = True
    try:
        yield
    finally:
        _state.on = outer


def in_graph_body(device: torch.device) -> bool:
    """Inside `graph_body`, or a capture on `device` that was not marked."""
    if getattr(_state, "on", False):
        return True
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()
