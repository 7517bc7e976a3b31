"""`DisaggScheduler`: what the PD queues (`PrefillBootstrapQueue`, `DecodeTransferQueue`) and the transfer
engine read and call of the scheduler, as a structural type, so that they name exactly that and never
import `managers/scheduler.py` (test/unit/test_import_graph.py checks it). The scheduler satisfies it as
it is; a test may pass any object with these members."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.scheduler_components.batch_result_processor import BatchResultProcessor
    from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.mem_cache.memory_pool import HybridReqToTokenPool
    from sglang.srt.server_args import ServerArgs


class DisaggScheduler(Protocol):
    server_args: ServerArgs
    model_runner: Any  # its `token_to_kv_pool`, whose buffers the transfer engine registers
    context_len: int
    max_running_requests: int
    req_to_token_pool: HybridReqToTokenPool
    token_allocator: PagedTokenAllocator
    tree_cache: BasePrefixCache
    result_processor: BatchResultProcessor  # releases, sends and streams what the queues finish
    counters: dict[str, int]
    running: list[Req]  # the decode side admits into it, the prefill side takes its hand-offs out
    num_batches: int  # batches built so far (a reservation waits for the batches in flight)
    processed_batch_id: int
    spec: Any  # None, or the speculative worker: EAGLE / NEXTN's `draft.stash` rows move (`draft_state.py`)
    worker: Any  # the forward worker: `call(fn)` runs fn on the forward stream after the batches so far

    def abort_with_status(
        self, reqs: list[Req], message: str, status_code: int | None = None, param: str | None = None
    ) -> None: ...
