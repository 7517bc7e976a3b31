"""Mixed chunked prefill (upstream's `--enable-mixed-chunk`): while a prefill batch runs, the running
requests' decode step rides in it, each as a one-token extend of its own sequence, instead of waiting
for the next decode batch. A long prompt chunked over several forwards then no longer stalls every
running request for as many forwards: each gets a token per chunk.

What a decode row of a mixed batch is (`ScheduleBatch.prepare_for_extend`, `MixedDecodeRows`): the
same step a decode batch would run for it, in the extend's form:
- the requests are the decode build's (`DecodeFastPath.select`, which counts this build as a decode
  build: each gets one planned token and one KV slot, `alloc_for_decode`'s), placed after the prefill
  rows; their input is their newest token, a placeholder while it is in flight (overlap);
- each extends its own KV by that one position (prefix = seq_len - 1) from its running state slot;
- a decode row whose step ends on a track boundary writes its snapshot as a decode step does
  (`MambaTracker.decode_track`, committed when the result is processed), through the extend's
  tracking of the state after the row's last token;
- the result processor commits its token as a decode step's (`BatchResultProcessor`: quick finish
  check, output logprobs, hidden states, the snapshot, release).
Upstream's mixing is known to corrupt hybrid models' cached states (sgl-project/sglang#39342): here
every strategy is checked against the transformers oracle and the cache rules
(test/unit/scheduler/test_mixed_chunk.py).

A step mixes only when every decode row can: none has images or video (their M-RoPE positions after the
prompt are a decode step's), and the decode step's KV slots fit without retracting anyone (else the
next decode batch retracts, as without mixing). Speculative decoding and PD disaggregation never mix
(`server_args.py`: off with a log line, as upstream for speculative decoding). As upstream, the running
requests' tokens come out of the pass's prompt-token budget (`mixed_prefill_tokens`), so that a mixed
forward stays within --chunked-prefill-size, which the activation memory and the warm-up's shapes are
sized for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from sglang.srt.mem_cache.common import alloc_for_decode

if TYPE_CHECKING:
    from sglang.srt.managers.req import Req
    from sglang.srt.managers.scheduler_components.decode_fast_path import DecodeFastPath
    from sglang.srt.mem_cache.allocator.token import PagedTokenAllocator
    from sglang.srt.mem_cache.base_prefix_cache import BasePrefixCache


def mixed_prefill_tokens(tokens: int, running: int, align: int) -> int:
    """The prompt tokens a prefill pass may take when the running requests may ride along: `tokens`
    less one per running request (upstream's rule), unless that leaves less than one chunk alignment
    `align` (a chunk is a multiple of it): then the whole budget, so that a prompt still progresses
    (its forward then holds up to `running` tokens more than the budget)."""
    left = tokens - running
    return left if left >= align else tokens


@dataclass
class MixedDecodeRows:
    """The decode rows of a mixed batch: the requests, the KV slot of each one's new position, and each
    one's KV length after it (`alloc_for_decode`'s)."""

    reqs: list[Req]
    out_cache_loc: list[int]
    seq_lens: list[int]


def take_decode_rows(
    running: list[Req],
    fast_path: DecodeFastPath,
    tree_cache: BasePrefixCache,
    token_allocator: PagedTokenAllocator,
) -> MixedDecodeRows | None:
    """The decode rows for the prefill batch being built, their KV slots allocated; None where this
    step does not mix. Call before the batch's new requests join `running`.

    The decode fast path's logs are flushed and its sets forgotten on both sides: a mixed step is a
    boundary that reads the requests' lists, and its result is committed outside the decode logs."""
    if not running:
        return None
    fast_path.clear()
    reqs = fast_path.select(running)
    if not reqs or any(r.multimodal_inputs is not None for r in reqs):
        return None  # (a selection not run leaves certificates conservative: they are re-read sooner)
    allocated = alloc_for_decode(tree_cache, token_allocator, reqs, fast_path.kv_log)
    fast_path.clear()  # page size 1: the new slots join the requests' kv_indices now
    if allocated is None:
        return None
    return MixedDecodeRows(reqs, *allocated)
