"""`ReqState`: what the TokenizerManager accumulates for one request, and the reply built from it.

Deltas from the detokenizer are appended; a reply (SGLang's native format) is:

    {"text": str, "output_ids": [int], "meta_info": {"id", "finish_reason", "prompt_tokens",
     "completion_tokens", "cached_tokens", "e2e_latency", and with return_logprob:
     "input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
     and with token_ids_logprob "input_token_ids_logprobs", "output_token_ids_logprobs", with
     --speculative-algorithm upstream's "spec_*" fields (`spec_meta_info`), and with
     return_hidden_states "hidden_states"}}

Logprob entries are `[logprob, token_id, text_or_None]` (text with return_text_in_logprobs); top
logprobs are such lists per position.

Streams: "text" and "output_ids" are cumulative in every chunk, as upstream streams them; the lists of
logprobs and "hidden_states" hold only what is new since the previous chunk, so the input logprobs and
the prompt's hidden states come once, in the first chunk that has them (an empty list after), and each
chunk carries its own output positions. Concatenated over the chunks, each list is the non-streamed
reply's. (Upstream re-sends every list whole in every chunk, quadratic in the output: 4 MB of logprobs
became 92.5 MB streamed.) `StreamMerger` rebuilds the whole lists for a reader that wants them.

Stop strings: the scheduler finishes a request on the step whose text completes a stop string, and
the text is cut where the string starts. While a request streams, text that may be the beginning of
a stop string is held back, so a streamed prefix is never taken back.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from sglang.srt.layers.logits_processor import rows_as_lists
from sglang.srt.managers.io_struct import BatchStrOut
from sglang.srt.managers.request_validation import NormalizedRequest
from sglang.srt.model_executor.routed_experts import encode as encode_routed_experts
from sglang.srt.utils.text_markers import StopScan

TokenTexts = Callable[[list[int]], list[str]]

# The lists of logprobs a reply carries (with return_logprob; the token_ids ones with token_ids_logprob).
LOGPROB_LISTS = (
    "input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs",
    "input_token_ids_logprobs", "output_token_ids_logprobs",
)  # fmt: skip
# A reply with more entries than this is built on a worker thread: building costs Python time per
# entry, so up to this many keep the event loop's other clients waiting only briefly, while a thread
# hop would dominate the small replies of every step of every stream (timings: benchmark/README.md).
OFF_LOOP_ENTRIES = 4096
# A reply whose stop-string scan has more than this many characters x stop strings to read scans on a
# worker thread. A non-streamed request's text is scanned once, whole, at its finish: 256 stops of 64
# characters over 16,000 characters took 10-30 ms of the loop per sample (~1-2 s for n=64 finishing
# together); the bound leaves a sample at most ~0.4 ms there, and a stream's chunk scans its own piece.
OFF_LOOP_SCAN = 1 << 16


class ReqState:
    def __init__(
        self, item: NormalizedRequest, created_time: float, event: asyncio.Event, log_metrics: bool = True
    ):
        self.item = item
        self.log_metrics = log_metrics
        self.req = item.req
        self.rid = item.req.rid
        self.index = item.index
        self.created_time = created_time
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.last_token_time: float | None = None  # the metrics' inter-token latency (streamed requests)
        # Shared by all states of one generate call: set when any of them changes.
        self.event = event

        self.text = ""
        self.output_ids: list[int] = []
        self.finished_reason: dict[str, Any] | None = None
        self.prompt_tokens = len(item.req.input_ids)
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_logprobs: list[tuple[float | None, int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]] | None] = []
        self.output_token_ids_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_ids_logprobs: list[list[tuple[float, int]] | None] = []
        self.spec_counts: list[int] | None = None  # with speculative decoding: `Req.spec_counts`
        self.hidden_states: list[list[float]] = []  # with return_hidden_states: one per position
        self.routed_experts: Any = None  # with return_routed_experts: the last message's rows (a tensor)
        self.got_message = False
        self._sent: tuple[int, int, bool] | None = None
        self._built: tuple[int, int, bool] | None = None  # the marker of the chunk built last
        # Streams: how much of each list of logprobs (and of hidden_states) earlier chunks carried.
        self._streamed: dict[str, int] = dict.fromkeys((*LOGPROB_LISTS, "hidden_states"), 0)
        self._stop_scan: StopScan | None = None  # the stop strings looked for as the text grows
        self._matched_at: tuple[int, int] | None = None  # (text length, where the matched stop begins)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def apply(self, out: BatchStrOut, i: int) -> bool:
        """Add the i-th entry of `out`; returns whether it carried the request's first tokens. Only a
        streaming request hears of its tokens as they come (a non-streaming one gets a single message
        at the end), so only there is the arrival a time to first token."""
        self.got_message = True
        first = self.first_token_time is None and self.req.stream and bool(out.output_ids[i])
        if first:
            self.first_token_time = time.time()
        self.text += out.output_strs[i]
        self.output_ids.extend(out.output_ids[i])
        self.prompt_tokens = out.prompt_tokens[i]
        self.completion_tokens = out.completion_tokens[i]
        self.cached_tokens = out.cached_tokens[i]
        self.spec_counts = _entry(out.spec_counts, i)
        routed = _entry(out.routed_experts, i)
        if routed is not None:
            self.routed_experts = routed
        rows = _entry(out.output_hidden_states, i)
        if rows is not None:
            self.hidden_states.extend(rows_as_lists(rows))  # (each row made a list once, here)
        if self.req.return_logprob:
            self.output_token_logprobs.extend(_entry(out.output_token_logprobs, i) or [])
            self.output_top_logprobs.extend(_entry(out.output_top_logprobs, i) or [])
            self.input_token_logprobs.extend(_entry(out.input_token_logprobs, i) or [])
            self.input_top_logprobs.extend(_entry(out.input_top_logprobs, i) or [])
            self.output_token_ids_logprobs.extend(_entry(out.output_token_ids_logprobs, i) or [])
            self.input_token_ids_logprobs.extend(_entry(out.input_token_ids_logprobs, i) or [])
        if out.finished_reasons[i] is not None:
            self.finished_reason = out.finished_reasons[i]
            self.finish_time = time.time()
        return first

    # ---- text --------------------------------------------------------------------------------------

    def visible_text(self) -> str:
        return self.text[: self.visible_len()]

    def visible_len(self) -> int:
        """How much of the text a reply shows: up to the earliest stop string (or the matched stop), and
        while the request runs, not the end that may still begin one. The stop strings are looked for
        in what arrived since the last call (`StopScan`), so a chunk costs its own text, not the whole."""
        text = self.text
        scan = self._stop_scan_to_do()
        if scan is None:
            return len(text)  # (nothing is trimmed: nothing to hold back either)
        scan.scan(text)
        end = len(text) if scan.cut is None else scan.cut
        if self.finished:
            matched = self.finished_reason.get("matched")
            if isinstance(matched, str):
                # (once: the finish is the last message, so the text no longer grows)
                if self._matched_at is None or self._matched_at[0] != len(text):
                    self._matched_at = (len(text), text.find(matched))
                at = self._matched_at[1]
                end = end if at < 0 else min(end, at)
            return end
        return end if scan.cut is not None else end - scan.hold

    def _stop_scan_to_do(self) -> StopScan | None:
        """The request's stop-string scan, made on first use; None when no stop string trims the text."""
        sp = self.req.sampling_params
        if not sp.stop or sp.no_stop_trim:
            return None
        if self._stop_scan is None:
            self._stop_scan = StopScan(sp.stop)
        return self._stop_scan

    # ---- streaming bookkeeping ---------------------------------------------------------------------

    def _marker(self) -> tuple[int, int, bool]:
        return (self.visible_len(), len(self.output_ids), self.finished)

    def has_unsent_update(self) -> bool:
        return self.got_message and self._marker() != self._sent

    def mark_sent(self) -> None:
        """The chunk built last was sent; what arrived while it was built is still to send."""
        self._sent = self._built if self._built is not None else self._marker()

    # ---- reply -------------------------------------------------------------------------------------

    def to_dict(self, token_texts: TokenTexts) -> dict[str, Any]:
        """The reply: whole, or for a stream the next chunk (see the module's docstring)."""
        return self._build(self._take(), token_texts)

    async def reply(self, token_texts: TokenTexts) -> dict[str, Any]:
        """`to_dict`, built on a worker thread when it is large, so that the event loop keeps serving
        the other clients meanwhile. What to include is decided here, on the loop, so messages that
        arrive while it is built go to the next chunk whole. A large stop-string scan runs on a worker
        thread first (only this request's coroutine scans its text; `apply` replaces the string, which
        the thread keeps reading whole), so `_take` finds it done."""
        scan = self._stop_scan_to_do()
        if scan is not None and scan.work(self.text) > OFF_LOOP_SCAN:
            await asyncio.to_thread(scan.scan, self.text)
        taken = self._take()
        return await built_off_loop_if_large(taken.entries, self._build, taken, token_texts)

    def _take(self) -> _Taken:
        """What the next reply holds, as it is now: the text, ids and counts, and a range of each list
        (for a stream, from where the previous chunk ended; the lists only grow)."""
        self._built = self._marker()
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finished_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "e2e_latency": (self.finish_time or time.time()) - self.created_time,
        }
        if self.spec_counts is not None:
            meta.update(spec_meta_info(self.spec_counts, self.completion_tokens))
        ranges: dict[str, tuple[int, int]] = {}
        entries = 0
        for name in (*LOGPROB_LISTS, "hidden_states"):
            values = getattr(self, name)
            start = self._streamed[name] if self.req.stream else 0
            end = len(values)
            if name == "hidden_states" and end < self.prompt_tokens:
                end = start  # the prompt's rows go out together, as the first element
            if self.req.stream:
                self._streamed[name] = end
            ranges[name] = (start, end)
            entries += (end - start) * (_width(values[start]) if end > start else 0)
        if self.routed_experts is not None:
            entries += self.routed_experts.numel()  # (encoded in `_build`: a long one off the event loop)
        reply = {"text": self.visible_text(), "output_ids": list(self.output_ids), "meta_info": meta}
        return _Taken(reply, ranges, entries)

    def _build(self, taken: _Taken, token_texts: TokenTexts) -> dict[str, Any]:
        """`taken`'s reply with its lists (reads only what `_take` fixed: safe on another thread)."""
        meta = taken.reply["meta_info"]
        if self.routed_experts is not None:
            meta["routed_experts"] = encode_routed_experts(self.routed_experts)
        if self.req.return_hidden_states:
            # Upstream's shape: the prompt's positions as one [prompt, hidden] list, then one [hidden]
            # per generated token fed back (the last token is never fed: one fewer than the outputs).
            n = self.prompt_tokens
            start, end = taken.ranges["hidden_states"]
            states = self.hidden_states
            prompt = [states[:n]] if start == 0 < end else []
            meta["hidden_states"] = prompt + states[max(start, n) : end]
        if self.req.return_logprob:
            texts = token_texts if self.item.return_text_in_logprobs else None

            def part(name: str) -> list[Any]:
                start, end = taken.ranges[name]
                return getattr(self, name)[start:end]

            meta["input_token_logprobs"] = _with_text(part("input_token_logprobs"), texts)
            meta["output_token_logprobs"] = _with_text(part("output_token_logprobs"), texts)
            for name in LOGPROB_LISTS[2:] if self.req.token_ids_logprob else LOGPROB_LISTS[2:4]:
                meta[name] = [_with_text(p, texts) if p else p for p in part(name)]
        return taken.reply


_gc_lock = threading.Lock()
_gc_builds = 0  # large replies being built; the collector is off while there is one
_gc_was_enabled = True


def without_gc(fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) with Python's cyclic collector off. A large reply adds millions of lists (in no
    cycle: reference counting frees them), and the full collections they set off hold the GIL for a
    long time wherever they run, so the loop stalled anyway; beside the largest reply the bound allows
    it stalls far less with the collector off, and the build is faster (timings: benchmark/README.md)."""
    global _gc_builds, _gc_was_enabled
    with _gc_lock:
        _gc_builds += 1
        if _gc_builds == 1:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
    try:
        return fn(*args)
    finally:
        with _gc_lock:
            _gc_builds -= 1
            if _gc_builds == 0 and _gc_was_enabled:
                gc.enable()


def reply_entries(meta: dict[str, Any]) -> int:
    """About how many values a whole reply's logprob lists hold (what OFF_LOOP_ENTRIES bounds), for a
    route that builds its own reply from the native one."""
    return sum(len(v) * _width(v[-1]) for name in LOGPROB_LISTS if (v := meta.get(name)))


async def built_off_loop_if_large(entries: int, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args): on a worker thread with the collector off where `entries` exceed OFF_LOOP_ENTRIES
    (the rule `ReqState.reply` keeps), else here on the event loop."""
    if entries > OFF_LOOP_ENTRIES:
        return await asyncio.to_thread(without_gc, fn, *args)
    return fn(*args)


class _Taken(NamedTuple):
    reply: dict[str, Any]  # text, output_ids and meta_info's counts
    ranges: dict[str, tuple[int, int]]  # list name -> [start, end) of it in this reply
    entries: int  # about how many values the reply's lists hold


def _width(first: Any) -> int:
    """The values per position of a list whose first position is `first` (a logprob entry, a position's
    top entries, or a hidden state)."""
    if isinstance(first, tuple):  # (logprob, token id)
        return 1
    return max(len(first or ()), 1)


class StreamMerger:
    """Whole lists from a stream's chunks (see the module's docstring), for readers that want them (the
    OpenAI routes slice their new part off the whole lists): `merge(meta)` extends the lists kept so
    far with a chunk's and returns the chunk's meta_info with them in their place (the merger's own
    lists, which the next merge extends: read them before it)."""

    def __init__(self) -> None:
        self._lists: dict[str, list[Any]] = {}

    def merge(self, meta: dict[str, Any]) -> dict[str, Any]:
        merged = dict(meta)
        for name in (*LOGPROB_LISTS, "hidden_states"):
            if name in meta:
                kept = self._lists.setdefault(name, [])
                kept.extend(meta[name])
                merged[name] = kept
        return merged


def spec_meta_info(counts: list[int], completion_tokens: int) -> dict[str, Any]:
    """Upstream's speculative fields of a request's meta_info, from `Req.spec_counts` ([drafts proposed,
    then at index k >= 1 the verifies that accepted k drafts]); none before its second token.
    Every forward after a request's first token commits one token plus the drafts it accepted, so
    `spec_verify_ct`, its forwards after the first token (verifies, and decode steps where no request
    had a draft, which upstream's NGRAM verifies too), is `completion_tokens - 1 - accepted`;
    `spec_accept_length` is `completion_tokens / spec_verify_ct` (the model's own token included, as
    upstream counts it); `spec_accept_rate` is accepted over proposed drafts (the drafts proposed, not
    `spec_verify_ct * (D - 1)`: NGRAM proposes fewer where its cache has less);
    `spec_accept_histogram[k]`: the forwards that accepted k drafts."""
    proposed, histogram = counts[0], [0, *counts[1:]]
    accepted = sum(k * n for k, n in enumerate(histogram))
    verify_ct = completion_tokens - 1 - accepted
    if verify_ct <= 0:
        return {}
    histogram[0] = verify_ct - sum(histogram)
    return {
        "spec_verify_ct": verify_ct,
        "spec_accept_length": completion_tokens / verify_ct,
        "spec_accept_rate": accepted / proposed if proposed else 0.0,
        "spec_num_correct_drafts": accepted,
        "spec_num_proposed_drafts": proposed,
        "spec_accepted_drafts": accepted,  # upstream's older names, which it still sends
        "spec_proposed_drafts": proposed,
        "spec_accept_histogram": histogram,
    }


def _entry(values: list[Any], i: int) -> Any:
    return values[i] if i < len(values) else None


def _with_text(entries: list[tuple[Any, int]], token_texts: TokenTexts | None) -> list[list[Any]]:
    if not entries:
        return []
    texts = token_texts([tid for _, tid in entries]) if token_texts else [None] * len(entries)
    return [[lp, tid, t] for (lp, tid), t in zip(entries, texts, strict=True)]
