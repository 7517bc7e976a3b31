"""`WeightUpdate`: /update_weights_from_disk on the scheduler's side; `named_tensors_of`, the payload of
/update_weights_from_tensor.

The new checkpoint loads on a thread of its own (`ModelRunner.load_like_current`: minutes for a large
model), while the scheduler's loop goes on: it keeps sending heartbeats (the watchdog stays quiet), and
any request still running decodes with the current weights meanwhile. The loop polls (`poll`); once
the model is loaded, the scheduler swaps it in between two steps (`Scheduler.finish_weight_update`),
with nothing in flight. One update at a time; a second one is refused while the first loads.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import torch

from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput
from sglang.srt.utils.multiprocessing_serializer import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

logger = logging.getLogger(__name__)


def in_background(work: Callable[[], Any], name: str) -> Future:
    """`work()` on a daemon thread (a scheduler that stops meanwhile exits without waiting for it); its
    result or exception in the future, for the loop to poll."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(work())
        except BaseException as e:  # noqa: BLE001 - handed to the loop, which reports it
            future.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class WeightUpdate:
    def __init__(self, load: Callable[[str], Any]):
        self.load = load
        self.pending: tuple[UpdateWeightFromDiskReqInput, Future, float] | None = None

    def start(self, req: UpdateWeightFromDiskReqInput) -> str | None:
        """Start loading `req.model_path`; None, or why it cannot start."""
        if self.pending is not None:
            return f"Another weight update (from {self.pending[0].model_path}) is still loading."
        logger.info("Loading new weights from %s.", req.model_path)
        future = in_background(lambda: self.load(req.model_path), "weight-update")
        self.pending = (req, future, time.monotonic())
        return None

    def poll(self) -> tuple[UpdateWeightFromDiskReqInput, Any, str] | None:
        """(the request, the loaded model or None, why not) once the load has ended; None before."""
        if self.pending is None or not self.pending[1].done():
            return None
        req, future, started = self.pending
        self.pending = None
        try:
            model = future.result()
        except Exception as e:  # noqa: BLE001 - any failure is the checkpoint's, told to the client
            reason = str(e).strip().rstrip(".") or type(e).__name__
            logger.warning("The weights at %s were not loaded: %s.", req.model_path, reason)
            return req, None, f"The weights at {req.model_path} cannot be served: {reason}."
        logger.info("New weights loaded from %s in %.2f s.", req.model_path, time.monotonic() - started)
        return req, model, ""


def named_tensors_of(
    payload: bytes | str, trusted: bool, load_format: str | None
) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a /update_weights_from_tensor payload: a list or tuple of them, or for
    "flattened_bucket" a FlattenedTensorBucket's dict; ValueError, in one sentence, where it is not."""
    named = MultiprocessingSerializer.deserialize(payload, trusted)
    if load_format == "flattened_bucket":
        return FlattenedTensorBucket.from_payload(named).reconstruct_tensors()
    if not isinstance(named, (list, tuple)):
        raise ValueError(f"the payload is a {type(named).__name__}, not a list of (name, tensor) pairs")
    bad = first_non_pair(named)
    if bad is not None:
        raise ValueError(f"item {bad} of the payload is not a (name, tensor) pair")
    return [(name, tensor) for name, tensor in named]


def first_non_pair(items: list | tuple) -> int | None:
    """The index of the first item that is not a (name, tensor) pair, or None."""
    for i, pair in enumerate(items):
        ok = isinstance(pair, (list, tuple)) and len(pair) == 2 and isinstance(pair[0], str)
        if not (ok and isinstance(pair[1], torch.Tensor)):
            return i
    return None


def payload_of_rank(payloads: list, tp_rank: int, tp_size: int, dp_rank: int | None, trusted: bool) -> Any:
    """The payload this rank decodes (upstream's rule: one per TP rank, rank r reading item r). A
    payload of handles (shared memory, CUDA IPC) opens once, so ranks must not share one; with --dp-size
    the Engine gives one per rank of every replica (replica d's rank r reading item d * tp_size + r). A
    single HTTP payload (`trusted` false) holds plain bytes, which every rank may read. ValueError, in
    one sentence, for another count."""
    n, replica = len(payloads), dp_rank or 0
    if n == tp_size:
        return payloads[tp_rank]
    if n == 1 and not trusted:
        return payloads[0]
    if n > replica * tp_size + tp_rank and n % tp_size == 0:
        return payloads[replica * tp_size + tp_rank]
    raise ValueError(
        f"serialized_named_tensors has {n} payload(s); with --tp-size {tp_size} give one per TP rank "
        f"(rank r reads item r)"
    )


class RankVote:
    """The ranks' one agreement on a weight write's outcome (`TpBroadcast.agree_outcome`, or the
    identity at one rank): cast `before_copy` once every tensor has fitted (it raises where another rank
    failed, so no rank copies anything), or `outcome` with a rank's own failure before that point."""

    def __init__(self, agree: Callable[[str | None], str | None]):
        self.agree = agree
        self.cast = False
        self.result: str | None = None

    def before_copy(self) -> None:
        self.cast = True
        self.result = self.agree(None)
        if self.result:
            raise ValueError(self.result)

    def outcome(self, error: str | None) -> str | None:
        """The agreed error (None: every rank wrote); votes `error` unless this rank has voted."""
        if not self.cast:
            self.cast = True
            return self.agree(error)
        return self.result or error
