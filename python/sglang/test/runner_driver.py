"""A scheduler-free driver around `ModelRunner`, for tests and benchmarks: it runs prefills (with
prefixes, in chunks, with snapshots) and decodes for given requests, allocating request rows, running
and track slots (through the runner's `HybridReqToTokenPool`) and KV pages (`PagedTokenAllocator`)
itself, and filling the deferred clear / copy fields as the scheduler does.

    driver = RunnerDriver(runner)
    req = driver.new_request()
    res = driver.extend([Extend(req, prompt[:64]), ...])       # one extend batch
    res = driver.decode([req, ...])                             # feeds each request's sampled token
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode, SamplingBatchInfo
from sglang.srt.model_executor.model_runner import GenerationBatchResult, ModelRunner


@dataclass(eq=False)
class DriverRequest:
    # The fields HybridReqToTokenPool reads and writes (the scheduler's Req has the same names).
    req_pool_idx: int | None = None
    mamba_pool_idx: int | None = None
    mamba_ping_pong_track_buffer: list[int] | None = None
    mamba_next_track_idx: int = 0
    mamba_needs_clear: bool = False
    mamba_extra_snapshots: list[tuple[int, int]] = field(default_factory=list)
    # Sampling.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    # Tokens the runner holds KV and state for, with their KV slots; positions from `owned_from` on
    # sit in pages this request owns.
    token_ids: list[int] = field(default_factory=list)
    kv_slots: list[int] = field(default_factory=list)
    owned_from: int = 0
    # The token sampled by the last forward, fed by the next decode.
    next_token: int | None = None

    @property
    def seq_len(self) -> int:
        return len(self.kv_slots)

    @property
    def track_slot(self) -> int:
        """The request's (first) track slot, under `extra_buffer` (`extra_buffer_lazy`, the default,
        keeps none: snapshot into a slot from `RunnerDriver.alloc_mamba_slots`, as its tracker does)."""
        assert self.mamba_ping_pong_track_buffer, (
            "this request has no track slot (extra_buffer_lazy keeps none: pass Extend.track_slot)"
        )
        return self.mamba_ping_pong_track_buffer[0]


@dataclass
class Extend:
    """One request's part of an extend batch."""

    req: DriverRequest
    tokens: list[int]
    # Snapshot: the state after `track_seqlen` tokens goes to `track_slot` (default: the request's).
    track_seqlen: int | None = None
    track_slot: int | None = None
    logprob_start: int = 0
    # The input token after this chunk (its logprob is returned with the input logprobs).
    next_token: int | None = None
    # Start a fresh request on the first n positions of another one: share its KV slots, and copy
    # `cow_src` (a slot holding the state after n tokens) into the running slot before the forward.
    prefix_from: tuple[DriverRequest, int] | None = None
    cow_src: int | None = None


class RunnerDriver:
    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.pool = runner.req_to_token_pool
        self.page_size = runner.server_args.page_size
        self.kv_allocator = PagedTokenAllocator(runner.pool_sizes.max_total_tokens, self.page_size)

    def new_request(
        self, temperature: float = 0.0, top_p: float = 1.0, top_k: int = -1, seed: int | None = None
    ) -> DriverRequest:
        req = DriverRequest(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        if self.pool.alloc([req]) is None:
            raise RuntimeError("The driver ran out of request rows or mamba slots.")
        return req

    def alloc_mamba_slots(self, n: int) -> list[int]:
        slots = self.pool.mamba_allocator.alloc(n)
        if slots is None:
            raise RuntimeError(f"The mamba pool has fewer than {n} free slots.")
        return slots

    def free(self, req: DriverRequest) -> None:
        self.kv_allocator.free(req.kv_slots[req.owned_from :])
        self.pool.free_mamba_cache(req)
        self.pool.free(req)

    def _sampling(self, reqs: Sequence[DriverRequest]) -> SamplingBatchInfo:
        return SamplingBatchInfo.create(
            [r.temperature for r in reqs],
            [r.top_p for r in reqs],
            [r.top_k for r in reqs],
            [r.seed for r in reqs],
        )

    def _alloc_kv(self, req: DriverRequest, n: int) -> list[int]:
        last = req.kv_slots[-1] if req.kv_slots else 0
        slots = self.kv_allocator.alloc_extend(req.seq_len, req.seq_len + n, last)
        if slots is None:
            raise RuntimeError("The driver ran out of KV pages.")
        return slots

    def extend(
        self,
        items: Sequence[Extend],
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
        forward: Callable[[ForwardBatch], Any] | None = None,
    ) -> GenerationBatchResult:
        """`forward` runs the batch (default: the runner's `forward_batch_generation`; e.g. the forward
        worker's path instead); what it returns needs `next_token_ids`."""
        reqs = [it.req for it in items]
        writes, clear, cow_src, cow_dst = [], [], [], []
        prefix, new_slots = [], []
        for it in items:
            req = it.req
            if it.prefix_from is not None:
                other, n = it.prefix_from
                assert req.seq_len == 0 and n % self.page_size == 0, "share whole pages into a fresh request"
                req.token_ids, req.kv_slots, req.owned_from = other.token_ids[:n], other.kv_slots[:n], n
                writes.append((req.req_pool_idx, 0, req.kv_slots))
            if req.mamba_needs_clear:
                clear.append(req.mamba_pool_idx)
                req.mamba_needs_clear = False
            if it.cow_src is not None:
                cow_src.append(it.cow_src)
                cow_dst.append(req.mamba_pool_idx)
            prefix.append(req.seq_len)
            new_slots.append(self._alloc_kv(req, len(it.tokens)))
        tracked = [it.track_seqlen is not None for it in items]
        fb = ForwardBatch.create(
            ForwardMode.EXTEND,
            input_ids=[t for it in items for t in it.tokens],
            req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=[p + len(it.tokens) for p, it in zip(prefix, items, strict=True)],
            out_cache_loc=[s for slots in new_slots for s in slots],
            mamba_pool_indices=[r.mamba_pool_idx for r in reqs],
            extend_prefix_lens=prefix,
            req_to_token_writes=writes,
            mamba_track_indices=(
                [_track_slot(it) if it.track_seqlen is not None else 0 for it in items]
                if any(tracked)
                else None
            ),
            mamba_track_mask=tracked if any(tracked) else None,
            mamba_track_seqlens=[it.track_seqlen or 0 for it in items] if any(tracked) else None,
            mamba_cow_src_indices=cow_src or None,
            mamba_cow_dst_indices=cow_dst or None,
            mamba_clear_indices=clear or None,
            sampling_info=self._sampling(reqs),
            return_logprob_mask=[return_logprob] * len(items),
            top_logprobs_nums=[top_logprobs_num] * len(items),
            extend_logprob_start_lens=[it.logprob_start for it in items],
            extend_logprob_next_ids=[it.next_token for it in items],
        )
        result = (forward or self.runner.forward_batch_generation)(fb)
        sampled = result.next_token_ids.tolist()  # one read of the device, not one per request
        for it, slots, token in zip(items, new_slots, sampled, strict=True):
            it.req.token_ids = it.req.token_ids + list(it.tokens)
            it.req.kv_slots = it.req.kv_slots + slots
            it.req.next_token = token
        return result

    def decode(
        self,
        reqs: Sequence[DriverRequest],
        input_ids: Sequence[int] | None = None,
        track: dict[DriverRequest, int] | None = None,
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
    ) -> GenerationBatchResult:
        """One token per request: `input_ids`, or each request's last sampled token. `track` maps a
        request to the slot that receives its state after this step."""
        fb = self.decode_batch(reqs, input_ids, track, return_logprob, top_logprobs_num)
        result = self.runner.forward_batch_generation(fb)
        for req, token in zip(reqs, result.next_token_ids.tolist(), strict=True):
            req.next_token = token
        return result

    def decode_batch(
        self,
        reqs: Sequence[DriverRequest],
        input_ids: Sequence[int] | None = None,
        track: dict[DriverRequest, int] | None = None,
        return_logprob: bool = True,
        top_logprobs_num: int = 0,
    ) -> ForwardBatch:
        """`decode`'s batch, not run (its KV slots are allocated and booked to the requests)."""
        tokens = list(input_ids) if input_ids is not None else [r.next_token for r in reqs]
        assert all(t is not None for t in tokens), "a request has no sampled token to feed"
        new_slots = [self._alloc_kv(r, 1)[0] for r in reqs]
        track = track or {}
        mask = [r in track for r in reqs]
        fb = ForwardBatch.create(
            ForwardMode.DECODE,
            input_ids=tokens,
            req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=[r.seq_len + 1 for r in reqs],
            out_cache_loc=new_slots,
            mamba_pool_indices=[r.mamba_pool_idx for r in reqs],
            mamba_track_indices=[track.get(r, 0) for r in reqs] if track else None,
            mamba_track_mask=mask if track else None,
            mamba_track_seqlens=[r.seq_len + 1 for r in reqs] if track else None,
            sampling_info=self._sampling(reqs),
            return_logprob_mask=[return_logprob] * len(reqs),
            top_logprobs_nums=[top_logprobs_num] * len(reqs),
        )
        for req, tok, slot in zip(reqs, tokens, new_slots, strict=True):
            req.token_ids = req.token_ids + [tok]
            req.kv_slots = req.kv_slots + [slot]
        return fb

    def verify(
        self,
        reqs: Sequence[DriverRequest],
        drafts: Sequence[Sequence[int]],
        return_logprob: bool = True,
        graph_shaped: bool = False,
        spec: Any = None,
        forward: Callable[[ForwardBatch], Any] | None = None,
    ) -> GenerationBatchResult:
        """A speculative verify of each request's last sampled token and its `drafts`: a token sampled
        at every position (result rows in the batch's token order), the state after each position in
        the pool's verify rows, the running slots untouched. The tokens are booked to the requests as
        if every draft were accepted; `next_token` becomes the last position's sampled token.
        `graph_shaped`: the drafts are of one length and the batch says so (`verify_width`), as the
        verifies a CUDA graph serves. `spec`: the batch's `ForwardBatch.spec` (e.g. an `MtpHook`);
        `forward` as `extend`'s."""
        counts = [1 + len(d) for d in drafts]
        tokens = [[r.next_token, *d] for r, d in zip(reqs, drafts, strict=True)]
        assert all(t[0] is not None for t in tokens), "a request has no sampled token to feed"
        new_slots = [self._alloc_kv(r, n) for r, n in zip(reqs, counts, strict=True)]
        fb = ForwardBatch.create(
            ForwardMode.TARGET_VERIFY,
            input_ids=[t for ts in tokens for t in ts],
            req_pool_indices=[r.req_pool_idx for r in reqs],
            seq_lens=[r.seq_len + n for r, n in zip(reqs, counts, strict=True)],
            out_cache_loc=[s for slots in new_slots for s in slots],
            mamba_pool_indices=[r.mamba_pool_idx for r in reqs],
            extend_prefix_lens=[r.seq_len for r in reqs],
            sampling_info=self._sampling(reqs).repeat_rows(counts),
            return_logprob_mask=[return_logprob] * sum(counts),
            top_logprobs_nums=[0] * sum(counts),
        )
        if graph_shaped:
            assert len(set(counts)) == 1, "a graph-shaped verify has drafts of one length"
            fb.verify_width = counts[0]
        fb.spec = spec
        result = (forward or self.runner.forward_batch_generation)(fb)
        sampled = result.next_token_ids.tolist()
        end = 0
        for req, ts, slots in zip(reqs, tokens, new_slots, strict=True):
            end += len(ts)
            req.token_ids = req.token_ids + ts
            req.kv_slots = req.kv_slots + slots
            req.next_token = sampled[end - 1]
        return result


def _track_slot(item: Extend) -> int:
    return item.track_slot if item.track_slot is not None else item.req.track_slot
