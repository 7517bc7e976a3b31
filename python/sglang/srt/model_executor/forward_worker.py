"""The forward stream: one FIFO worker thread that runs every write to model state (KV, conv, SSM).

FIFO order is the only ordering guarantee the scheduler relies on: a slot freed or handed to the tree
while a batch that writes it is still queued or running is safe, because whatever later reads or
reuses it is a later task on the same stream.

Overlap: batch N+1 is launched before N's sampled tokens reach the scheduler, so N+1 names them by
placeholders: input id -(k + 1) means "the token sampled into future slot k". The worker resolves
placeholders against `token_lookup` right before the forward; the batch that samples them ran first.
`token_lookup` lives on the model's device and is written and read there, so a placeholder never
makes the stream wait for the host. It is [0, 1, ..., V - 1 | future slot F - 1, ..., future slot 0]
(V token ids, F future slots): a token id indexes itself and a placeholder -(k + 1), as torch wraps a
negative index, future slot k, so a batch's ids resolve in one gather (six kernels with a `where`).

On CPU the forward stream runs on the scheduler thread by default (`inline`): `launch` runs the batch
at once and returns a done future, so the FIFO order holds trivially and every overlap code path
(placeholders, future slots, processing N after launching N+1) runs unchanged. A thread of its own buys
nothing there (the forward's many small torch ops hold the GIL between them, so the scheduler's Python
runs between them, not beside them) and costs a wake-up on another core per batch, which made every
decode step longer (timings: benchmark/README.md; `SGLANG_CPU_FORWARD_THREAD` keeps the thread; the
overlap-race tests use it to hold the stream).

Results: on CPU the worker returns them as host values (`HostBatchResult`). On a device the sampled
ids and their logprobs are the only device-to-host copy of a step: on CUDA the worker starts it
(non-blocking, into pinned memory) and records an event; `PendingResult.wait`, called by the scheduler
when it processes the batch, waits for that event alone, so the worker thread goes on launching the
next batch meanwhile. The event is waited for by `CopyWaiter`'s thread, in C without the GIL, and the
scheduler blocks on a future it completes (no polling: see `CopyWaiter`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeoutError
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from sglang.srt.environ import envs
from sglang.srt.layers.logits_processor import HiddenRows
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.utils.host_tensors import host_int64

logger = logging.getLogger(__name__)

TopLogprobs = tuple[list[float], list[int]]


@dataclass
class HostBatchResult:
    """A batch's results as host values: what the worker returns on CPU, and what `PendingResult.wait`
    makes from the one result copy on a device."""

    next_token_ids: list[int]
    next_token_logprobs: list[float] | None = None
    next_token_top_logprobs: list[TopLogprobs | None] | None = None
    input_token_logprobs: list[list[float]] | None = None
    input_top_logprobs: list[list[TopLogprobs]] | None = None
    next_token_ids_logprobs: list[TopLogprobs | None] | None = None
    input_token_ids_logprobs: list[list[TopLogprobs]] | None = None
    # return_hidden_states: per request its rows [n, hidden] (float32, on the host) or None.
    hidden_states: list[torch.Tensor | None] | None = None

    def wait(self, timeout: float | None = None) -> HostBatchResult:
        """Already on the host (the same call as `PendingResult.wait`)."""
        return self


@dataclass
class PendingResult:
    """A batch's results on their way to the host (see the module docstring)."""

    # [1 or 2, bs] on the host (pinned on CUDA): the sampled ids, then their logprobs if any
    # (`results_to_host`: int64 ids alone, float64 with logprobs).
    packed: torch.Tensor
    has_logprobs: bool
    next_token_top_logprobs: list[TopLogprobs | None] | None
    input_token_logprobs: list[list[float]] | None
    input_top_logprobs: list[list[TopLogprobs]] | None
    next_token_ids_logprobs: list[TopLogprobs | None] | None = None
    input_token_ids_logprobs: list[list[TopLogprobs]] | None = None
    hidden_states: HiddenRows | None = None  # its rows copied to the host with the results
    copied: Future | None = None  # done when the copy is (`CopyWaiter.watch`); None: already on the host

    def wait(self, timeout: float | None = None) -> HostBatchResult:
        """The host values, once the copy is done; raises TimeoutError after `timeout` seconds (the
        scheduler's watchdog: the worker returns at launch, so a hung device shows here)."""
        if self.copied is not None:
            try:
                self.copied.result(timeout)
            except FutureTimeoutError:  # (the builtin TimeoutError from Python 3.11 on, not before)
                raise TimeoutError from None
        rows = self.packed.tolist()
        return HostBatchResult(
            next_token_ids=[int(x) for x in rows[0]],
            next_token_logprobs=rows[1] if self.has_logprobs else None,
            next_token_top_logprobs=self.next_token_top_logprobs,
            input_token_logprobs=self.input_token_logprobs,
            input_top_logprobs=self.input_top_logprobs,
            next_token_ids_logprobs=self.next_token_ids_logprobs,
            input_token_ids_logprobs=self.input_token_ids_logprobs,
            hidden_states=None if self.hidden_states is None else self.hidden_states.per_request(),
        )


class CopyWaiter:
    """Waits for the result copies' events, in the order they were recorded (one stream, so they
    complete in that order), on a thread of its own, and completes each one's future.

    `event.synchronize()` waits in C with the GIL released (on CUDA's default flags it spins on its
    core meanwhile, which is what the lowest wake-up latency costs); the scheduler blocks on the future
    (a lock: no GIL either) and wakes when it is done. Polling `event.query()` every 50 us from the
    scheduler thread instead took the GIL at every poll from the forward thread, launching the next
    batch meanwhile (it gives the GIL up at each torch op). `benchmark/bench_result_wait.py` on the CPU
    VM, the GIL's part alone (its stand-in event sleeps, where CUDA's spins): beside busy cores a thread
    of torch ops slowed down less beside this waiter than beside a poller; with idle cores both cost
    about the same, so on a GPU machine's many cores the gain may be small (timings: benchmark/README.md,
    "Waiting for a result copy")."""

    def __init__(self, device: torch.device | None = None) -> None:
        """`device`: the CUDA device whose events it waits for (made current on its thread)."""
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._device = device
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="result-copies", daemon=True)
        self._thread.start()

    def watch(self, event: Any) -> Future:
        """A future done once `event` (anything with `synchronize()`) has completed, or failed with
        the error its wait raised."""
        if self._closed:
            raise RuntimeError("the result copies' waiter was shut down")
        fut: Future = Future()
        self._events.put((event, fut))
        return fut

    def shutdown(self) -> None:
        self._closed = True
        self._events.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        failed: BaseException | None = None
        if self._device is not None:
            try:
                torch.cuda.set_device(self._device)
            except BaseException as e:  # noqa: BLE001 - every copy's wait fails with it
                failed = e
        while True:
            item = self._events.get()
            if item is None:
                return
            event, fut = item
            try:
                if failed is not None:
                    raise failed
                event.synchronize()
            except BaseException as e:  # noqa: BLE001 - raised where the scheduler waits
                fut.set_exception(e)
            else:
                fut.set_result(None)


def rows_to_host(rows: torch.Tensor) -> torch.Tensor:
    """A copy of device `rows` started into pinned host memory, on the current stream (done by the time
    an event recorded after it is)."""
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=rows.device.type == "cuda")
    host.copy_(rows, non_blocking=True)
    return host


def results_to_host(ids: torch.Tensor, logprobs: torch.Tensor | None) -> tuple[torch.Tensor, Any]:
    """Start the step's one device-to-host copy of device results [1 or 2, bs]: the ids as they are
    (int64) when there are no logprobs (no kernel before the copy), else ids and logprobs stacked as
    float64 (exact for token ids below 2**53 and for float32 logprobs). On CUDA into pinned memory
    without blocking, returning an event recorded after it; elsewhere a plain copy and no event."""
    if logprobs is None:
        packed = ids.reshape(1, -1)
    else:
        packed = torch.stack([ids.to(torch.float64), logprobs.to(torch.float64)])
    if packed.device.type != "cuda":
        return packed.cpu(), None
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


@dataclass
class LaunchedBatch:
    """What the worker needs to run one batch."""

    forward_batch: ForwardBatch
    # Future slot of each request's sampled token (None: nothing to store).
    future_slots: Sequence[int] | None = None
    # What runs on the forward stream before the batch, in order (`pre_forward_ops`): timed with it.
    pre_forward: list[Callable[[], None]] = field(default_factory=list)
    # Whether input ids hold placeholders (decided on the host: no device check on the way).
    has_placeholders: bool = False
    batch_id: int = 0


def pre_forward_ops(batch: Any, tree_cache: Any, mamba_pool: Any) -> list[Callable[[], None]]:
    """A `ScheduleBatch`'s work before its forward, in this order: the host tier's copies sealed into it
    (`BasePrefixCache.take_host_copies`; the tree's state copies run in order among them), then the
    tree's state copies where there is no host tier (`no_buffer` snapshots). Its COW copies and clears
    follow, in the forward itself."""
    ops: list[Callable[[], None]] = []
    if batch.host_copies:
        ops.append(partial(tree_cache.run_host_copies, batch.host_copies))
    if batch.state_copies:
        src, dst = (list(c) for c in zip(*batch.state_copies, strict=True))
        ops.append(partial(mamba_pool.copy_from, src, dst))
    return ops


def run_state_ops_here(batch: Any, mamba_pool: Any) -> None:
    """Negative control of the race tests (SGLANG_TEST_COW_ON_SCHEDULER_THREAD): a `ScheduleBatch`'s
    state copies, clears and COW copies run at once, on the calling (scheduler) thread, off the forward
    stream."""
    fb = batch.forward_batch
    if batch.state_copies:
        mamba_pool.copy_from([s for s, _ in batch.state_copies], [d for _, d in batch.state_copies])
    if fb.mamba_clear_indices is not None:
        mamba_pool.clear_slots(fb.mamba_clear_indices)
    if fb.mamba_cow_src_indices is not None:
        mamba_pool.copy_from(fb.mamba_cow_src_indices, fb.mamba_cow_dst_indices)
    batch.state_copies = []
    fb.mamba_clear_indices = fb.mamba_cow_src_indices = fb.mamba_cow_dst_indices = None


class RanFuture(Future):
    """The future of a batch run on the launching thread (inline): done at launch, with how long the
    forward took, which the scheduler's watchdog reads in place of a wait that could time out."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds


def placeholders(slots: Sequence[int]) -> Sequence[int]:
    """The placeholders of future slots, -(slot + 1) each (a `range` for a `range`): the input ids a
    later batch names their tokens by, and the slots' indices in `token_lookup`."""
    if isinstance(slots, range):
        return range(~slots.start, ~slots.stop, -1)
    return [~s for s in slots]


def token_id_bound(model_runner) -> int:
    """One past the largest token id a batch can hold: the vocabulary the requests are checked against,
    or the lm_head's rows (what sampling can pick) where more."""
    rows = getattr(getattr(model_runner.model, "lm_head", None), "weight", None)
    vocab = model_runner.server_args.model_config.vocab_size
    return max(vocab, rows.shape[0]) if rows is not None else vocab


class ForwardWorker:
    def __init__(
        self, model_runner, future_size: int, threads: int | None = None, inline: bool | None = None
    ):
        """`inline` None: on CPU unless SGLANG_CPU_FORWARD_THREAD is set (see the module docstring)."""
        self.model_runner = model_runner
        self.device = torch.device(model_runner.device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        # Future slots are the scheduler's (`InflightBatches` takes this size): a slot past it would land
        # in the token ids' part of `token_lookup`.
        self.future_size = future_size
        ids = torch.arange(token_id_bound(model_runner), device=self.device)
        self.token_lookup = torch.cat([ids, ids.new_zeros(future_size)])
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._threads = threads
        # Test hooks: called on the forward stream before each batch (may block to hold the stream).
        self.before_batch_hooks: list[Callable[[LaunchedBatch], None]] = []
        if inline is None:
            inline = self.device.type == "cpu" and not envs.SGLANG_CPU_FORWARD_THREAD.get()
        self.inline = inline
        # Host time spent running batches, summed (the scheduler's `loop_times` reports it).
        self.busy_seconds = 0.0
        self._thread: threading.Thread | None = None
        # Where a result copy takes an event (CUDA), the thread that waits for them.
        self.copy_waiter = CopyWaiter(self.device) if self.device.type == "cuda" else None
        if inline:
            if threads:
                torch.set_num_threads(threads)
        else:
            self._thread = threading.Thread(target=self._loop, name="forward-stream", daemon=True)
            self._thread.start()

    # ---- scheduler side --------------------------------------------------------------------------

    def launch(self, item: LaunchedBatch) -> Future:
        if self.inline:
            start = time.monotonic()
            try:
                result = self._run_batch(item)
            except Exception as e:  # noqa: BLE001 - re-raised where the scheduler takes the result
                logger.exception("The forward stream failed.")
                fut = RanFuture(time.monotonic() - start)
                fut.set_exception(e)
                return fut
            fut = RanFuture(time.monotonic() - start)
            fut.set_result(result)
            return fut
        fut: Future = Future()
        self._tasks.put((self._run_batch, item, fut))
        return fut

    def copy_states(self, copies: list[tuple[int, int]]) -> None:
        """Mamba state copies `(src, dst)` as a task of their own on the forward stream, after every batch
        launched so far and before any later one; returns once the task ran (on CUDA: once the copies
        are queued on the stream), and raises what it raised. For what the scheduler settles between
        batches (a speculative verify's accepted states): the slots hold those states before anything
        outside the stream may touch them (a PD transfer into a slot given back: CPU only)."""
        if not copies:
            return
        src, dst = (list(c) for c in zip(*copies, strict=True))
        pool = self.model_runner.req_to_token_pool.mamba_pool

        def run(_) -> None:
            pool.copy_from(src, dst)

        if self.inline:
            run(None)
            return
        done: Future = Future()
        self._tasks.put((run, None, done))
        done.result()  # (the stream is idle between a verify and the next batch: no wait behind a forward)

    def call(self, fn: Callable[[], Any]) -> Any:
        """`fn()` as a task on the forward stream, after every batch launched so far; returns its result
        (EAGLE / NEXTN's draft steps, whose drafts the verify batch is built from)."""
        if self.inline:
            return fn()
        done: Future = Future()
        self._tasks.put((lambda _: fn(), None, done))
        return done.result()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._tasks.put(None)
            self._thread.join(timeout=10)
        if self.copy_waiter is not None:
            self.copy_waiter.shutdown()

    # ---- worker side -------------------------------------------------------------------------------

    def _loop(self) -> None:
        if self._threads:
            torch.set_num_threads(self._threads)
        if self.device.type == "cuda":
            # The forward stream is a CUDA stream of its own: everything this thread launches is
            # ordered on it, in FIFO order, and the scheduler thread never waits on it except in
            # `PendingResult.wait`.
            torch.cuda.set_device(self.device)
            stream = torch.cuda.Stream(self.device)
            # Ordered after what startup launched on the default stream (weights, pools, this map).
            stream.wait_stream(torch.cuda.current_stream(self.device))
            torch.cuda.set_stream(stream)
        while True:
            task = self._tasks.get()
            if task is None:
                return
            fn, arg, fut = task
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(arg))
            except BaseException as e:  # noqa: BLE001 - the scheduler re-raises it where it waits
                logger.exception("The forward stream failed.")
                fut.set_exception(e)

    def _run_batch(self, item: LaunchedBatch):
        for hook in self.before_batch_hooks:
            hook(item)
        delay = envs.SGLANG_TEST_FORWARD_DELAY_MS.get()
        if delay:
            time.sleep(delay / 1000)
        start = time.perf_counter()  # (the test hooks and delay above are not the forward's)
        try:
            return self._run_batch_body(item)
        finally:
            self.busy_seconds += time.perf_counter() - start

    def _run_batch_body(self, item: LaunchedBatch):
        fb = item.forward_batch
        for op in item.pre_forward:
            op()
        if item.future_slots:
            # Where the future slots sit in `token_lookup`: at their placeholders.
            fb.future_slots = host_int64(placeholders(item.future_slots))
        self.model_runner.move_batch(fb)
        if item.has_placeholders:
            fb.input_ids = self.token_lookup[fb.input_ids]
        result = self.model_runner.forward_batch_generation(fb)
        if fb.future_slots is not None:
            # A device-side write: the next batch's placeholders read it on this stream, no host trip.
            self.token_lookup[fb.future_slots] = result.next_token_ids
        lp = result.next_token_logprobs
        if result.next_token_ids.device.type == "cpu":
            # Nothing to copy: the host values are made here, off the scheduler thread.
            return HostBatchResult(
                next_token_ids=result.next_token_ids.tolist(),
                next_token_logprobs=None if lp is None else lp.tolist(),
                next_token_top_logprobs=result.next_token_top_logprobs,
                input_token_logprobs=result.input_token_logprobs,
                input_top_logprobs=result.input_top_logprobs,
                next_token_ids_logprobs=result.next_token_ids_logprobs,
                input_token_ids_logprobs=result.input_token_ids_logprobs,
                hidden_states=None if result.hidden_states is None else result.hidden_states.per_request(),
            )
        hidden = result.hidden_states
        if hidden is not None:  # (queued before the results' copy: its event covers this one too)
            hidden = replace(hidden, rows=rows_to_host(hidden.rows))
        packed, event = results_to_host(result.next_token_ids, lp)
        copied = None if event is None else self.copy_waiter.watch(event)
        return PendingResult(
            packed=packed,
            has_logprobs=lp is not None,
            next_token_top_logprobs=result.next_token_top_logprobs,
            input_token_logprobs=result.input_token_logprobs,
            input_top_logprobs=result.input_top_logprobs,
            next_token_ids_logprobs=result.next_token_ids_logprobs,
            input_token_ids_logprobs=result.input_token_ids_logprobs,
            hidden_states=hidden,
            copied=copied,
        )
