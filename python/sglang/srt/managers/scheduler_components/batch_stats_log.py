"""Upstream's batch log lines, at INFO on the scheduler's logger: one per prefill batch launched,

    Prefill batch. #new-seq: 3, #new-token: 412, #cached-token: 1024, token usage: 0.12, mamba usage: 0.25, #running-req: 5, #queue-req: 0

and one every `--decode-log-interval` decode batches,

    Decode batch. #running-req: 16, #token: 3420, token usage: 0.21, mamba usage: 0.31, cuda graph: True, gen throughput (token/s): 812.44, #queue-req: 0

The throughput is the tokens of the decode batches launched since the previous decode line, over the
time between that line's batch and this one's; a window opens at the first decode batch after the
scheduler was idle (`reset`), so idle time never counts. `cuda graph`: a graph the model runner
captured serves the batch (a decode, or a verify of the graphs' width). Usage counts what requests
and the tree's locked nodes hold, not what the radix tree keeps and could evict (as upstream counts
it); `#token` is that many KV slots. With the scheduler's logger above INFO no line is formatted.

It also keeps what /metrics reads of the batches (`metrics_state`, in upstream's metric names): the
last window's throughput (sglang:gen_throughput), the last prefill batch's cache hit rate, the tokens
prefilled, taken from the cache and decoded (sglang:realtime_tokens_total), and each request's queue
time, from its arrival at the scheduler to the launch of its first prefill chunk
(sglang:queue_time_seconds).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sglang.srt.metrics.histogram import QUEUE_TIME_BUCKETS, PlainHistogram

if TYPE_CHECKING:
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.mem_cache.allocator.mamba import MambaSlotAllocator
    from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger("sglang.srt.managers.scheduler")


class BatchStatsLog:
    def __init__(
        self,
        interval: int,
        tokens: PagedTokenAllocator,
        mamba: MambaSlotAllocator,
        tree: BasePrefixCache,
        graph_check: Callable[[ForwardBatch], bool] | None = None,
    ):
        """`graph_check(fb)`: whether a captured CUDA graph serves the forward batch (None: no graphs)."""
        self.interval = interval
        self.tokens, self.mamba, self.tree = tokens, mamba, tree
        self.graph_check = graph_check
        self._decodes = 0  # decode batches of the window
        self._generated = 0  # their tokens
        self._since: float | None = None  # the window's opening launch; None: the next decode opens one
        # Speculative decoding: the worker's totals (`NgramWorker.stats`), and their values when the
        # window opened; a verify's tokens beyond one per request are added as they are committed.
        self.spec_stats: dict[str, int] | None = None
        self._spec_since = (0, 0)
        # /metrics: kept while the scheduler idles (upstream's gauges keep their last value too).
        self.gen_throughput = 0.0
        self.cache_hit_rate = 0.0
        self.realtime_tokens = {"prefill_compute": 0, "prefill_cache": 0, "decode": 0}
        self.queue_time = PlainHistogram(QUEUE_TIME_BUCKETS)

    def reset(self) -> None:
        """The scheduler is idle: the next decode batch opens a new window."""
        self._decodes, self._generated, self._since = 0, 0, None

    def reset_counts(self) -> None:
        """What /metrics reads starts from zero (`Scheduler.reset_counts`)."""
        self.reset()
        self._spec_since = (0, 0)
        self.gen_throughput = self.cache_hit_rate = 0.0
        self.realtime_tokens = dict.fromkeys(self.realtime_tokens, 0)
        self.queue_time = PlainHistogram(QUEUE_TIME_BUCKETS)

    def add_generated(self, tokens: int) -> None:
        """Tokens a batch committed beyond the one per request counted at its launch."""
        self.realtime_tokens["decode"] += tokens
        if self._since is not None:
            self._generated += tokens

    def _accept_len(self) -> str:
        """", accept len: x" (tokens committed per request and verify since the window opened), or ""."""
        stats = self.spec_stats
        if stats is None:
            return ""
        steps, tokens = stats["verify_steps"], stats["committed_tokens"]
        d_steps, d_tokens = steps - self._spec_since[0], tokens - self._spec_since[1]
        self._spec_since = (steps, tokens)
        return f", accept len: {d_tokens / d_steps:.2f}" if d_steps else ""

    def on_launch(self, batch: ScheduleBatch, running: int, queued: int) -> None:
        if batch.forward_mode.is_decode() or batch.forward_mode.is_target_verify():
            self.realtime_tokens["decode"] += batch.batch_size
            now = time.monotonic()
            if self._since is None:
                self._since = now  # its tokens come after the window opens: not counted
                return
            self._decodes += 1
            self._generated += batch.batch_size
            if self._decodes < self.interval:
                return
            throughput = self._generated / max(now - self._since, 1e-9)
            self.gen_throughput = throughput
            self._decodes, self._generated, self._since = 0, 0, now
            if logger.isEnabledFor(logging.INFO):
                used, token_usage, mamba_usage = self.usage()
                graph = self.graph_check is not None and self.graph_check(batch.forward_batch)
                logger.info(
                    "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, mamba usage: %.2f, "
                    "cuda graph: %s, gen throughput (token/s): %.2f, #queue-req: %d%s",
                    batch.batch_size, used, token_usage, mamba_usage, graph, throughput, queued,
                    self._accept_len(),
                )  # fmt: skip
        elif batch.forward_mode.is_extend():
            self._on_prefill(batch)
            if not logger.isEnabledFor(logging.INFO):
                return
            _, token_usage, mamba_usage = self.usage()
            decoding = batch.num_decode_rows  # a mixed batch's decode rows (`mixed_chunk.py`)
            logger.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                "mamba usage: %.2f, #running-req: %d, #queue-req: %d%s",
                batch.batch_size - decoding, batch.forward_batch.num_tokens - decoding, batch.cached_tokens,
                token_usage, mamba_usage, running, queued, f", #mixed-decode-req: {decoding}" if decoding else "",
            )  # fmt: skip

    def _on_prefill(self, batch: ScheduleBatch) -> None:
        fb = batch.forward_batch
        self.add_generated(batch.num_decode_rows)  # (a mixed batch's decode rows: their window's too)
        computed, cached = fb.num_tokens - batch.num_decode_rows, batch.cached_tokens
        self.realtime_tokens["prefill_compute"] += computed
        self.realtime_tokens["prefill_cache"] += cached
        self.cache_hit_rate = cached / (computed + cached) if computed + cached else 0.0
        now = time.monotonic()
        for req, prefix in zip(batch.reqs, fb.extend_prefix_lens_cpu, strict=True):
            # Its first chunk: a later chunk starts past the prefix its admission matched, and a
            # retracted request's fill_ids carry its outputs.
            if prefix == req.cached_tokens and len(req.fill_ids) == len(req.origin_input_ids):
                self.queue_time.observe(now - req.created_time)

    def metrics_state(self) -> dict[str, Any]:
        used, _, _ = self.usage()
        return {
            "num_used_tokens": used,
            "gen_throughput": self.gen_throughput,
            "cache_hit_rate": self.cache_hit_rate,
            "realtime_tokens": dict(self.realtime_tokens),
            "queue_time": self.queue_time.snapshot(),
        }

    def usage(self) -> tuple[int, float, float]:
        """(KV slots in use, their share of the pool, the share of mamba slots in use), the tree's
        evictable entries not counted."""
        kv, mamba = self.tokens, self.mamba
        used = kv.size - kv.available_size() - self.tree.evictable_size()
        mamba_used = mamba.size - mamba.free_list_size() - self.tree.mamba_evictable_size()
        return used, used / max(kv.size, 1), mamba_used / max(mamba.size, 1)
