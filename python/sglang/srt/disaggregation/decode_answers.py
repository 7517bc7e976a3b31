"""The decode side's handling of its prefill servers' answers (`DecodeTransferQueue` in `decode.py`
takes them in `poll`): a "done" checked whole and, accepted, its first token committed (with the MTP
stash row under EAGLE / NEXTN: `draft_state.py`; on the staged path once its last chunk is unpacked,
those of all the answers a poll accepted together); a staged "chunk" unpacked from the request's staging
range and acknowledged. A refusal fails its request alone."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sglang.srt.disaggregation.draft_state import answered_stash_row, write_stash_rows

if TYPE_CHECKING:
    from sglang.srt.disaggregation.pd_ranks import PdRanks
    from sglang.srt.disaggregation.scheduler_view import DisaggScheduler
    from sglang.srt.disaggregation.staging import StagedRange, Staging
    from sglang.srt.managers.schedule_batch import Req

    # An accepted "done": its fields, its MTP stash row or None, and on the staged path its range's key,
    # the range and the last chunk (unpacked with the poll's others: `_unpack_last_chunks`), else None.
    Arrived = tuple[Req, dict[str, Any], Any, tuple[str, StagedRange, list] | None]


class DecodeAnswers:
    """`DecodeTransferQueue`'s methods for its prefill servers' answers; the queue's fields they use
    (set by its constructor) are these."""

    sched: DisaggScheduler
    ranks: PdRanks
    now: float
    staging: Staging | None
    staged: dict[str, StagedRange]
    transfers: dict[str, tuple[Req, float]]
    zombies: dict[str, tuple[Req, float]]
    ready: list[Req]
    stats: dict[str, Any]

    def _on_done(self, msg: dict[str, Any], arrived: list[Arrived]) -> None:
        """A "done" answer, checked whole (a refusal fails its request alone); accepted: into `arrived`."""
        key = str(msg["room"])
        if key in self.zombies:
            req, _ = self.zombies.pop(key)
            self.sched.result_processor.release_finished(req)
            return
        entry = self.transfers.pop(key, None)
        if entry is None:
            return  # a room this server gave up already
        req = entry[0]
        try:  # (all of it before anything is committed: a malformed answer fails its request whole)
            answer = _read_done(msg) if msg.get("ok") else None
            error = msg.get("error") or "no first token came with the state"
        except (KeyError, TypeError, ValueError) as e:
            answer, error = None, f"a malformed answer ({str(e)[:200]})"
        if answer is None or (not answer["output_ids"] and req.sampling_params.max_new_tokens > 0):
            self.stats["failed_transfers"] += 1
            self.sched.abort_with_status([req], f"KV transfer from the prefill server failed: {error}", 500)
            return
        last = None
        if key in self.staged:  # the last chunk: checked here, unpacked with the poll's others (below)
            entry, chunk = self.staged[key], msg.get("chunk")
            error = self.staging.refusal(entry, chunk)
            if error is None and not chunk[2]:
                error = f"the staged transfer ended after {chunk[1]} positions (state: False)"
            if error is not None:  # its range is freed with the request
                self.stats["failed_transfers"] += 1
                self.sched.abort_with_status([req], f"KV transfer from the prefill server failed: {error}", 500)
                return
            last = (key, entry, chunk)
        row = answered_stash_row(self.sched, msg)  # (EAGLE / NEXTN: what the first verify drafts from)
        if isinstance(row, str):
            self.stats["failed_transfers"] += 1
            self.sched.abort_with_status([req], f"KV transfer from the prefill server failed: {row}", 500)
            return
        arrived.append((req, answer, row, last))

    def _unpack_last_chunks(self, arrived: list[Arrived]) -> list[Arrived]:
        """The staged last chunks of the answers this poll accepted, unpacked into the pools together: one
        `Staging.receive_many` (on CUDA one copy-stream wait, not one per transfer). A chunk that cannot
        be written fails its request alone (at one TP rank; under TP it raises: `Staging.receive_many`);
        the others' ranges are freed. Returns the answers still accepted."""
        staged = [(req, last) for req, _, _, last in arrived if last is not None]
        if not staged:
            return arrived
        errors = self.staging.receive_many([(entry, chunk) for _, (_, entry, chunk) in staged])
        failed = set()
        for (req, (key, entry, _)), error in zip(staged, errors, strict=True):
            if error is not None:  # its range is freed with the request
                failed.add(key)
                self.stats["failed_transfers"] += 1
                message = f"KV transfer from the prefill server failed: {error}"
                self.sched.abort_with_status([req], message, 500)
                continue
            del self.staged[key]
            self.staging.free(entry.start)
            self.stats["staged_chunks"] += 1
        return [a for a in arrived if a[3] is None or a[3][0] not in failed]

    def _on_arrived(self, arrived: list[Arrived]) -> None:
        """The requests whose answers this poll accepted: their staged last chunks unpacked together, their
        MTP stash rows written in one forward-stream call (EAGLE / NEXTN), then their first tokens
        committed."""
        arrived = self._unpack_last_chunks(arrived)
        rows = [(req.req_pool_idx, row) for req, _, row, _ in arrived if row is not None]
        write_stash_rows(self.sched, rows)
        processor = self.sched.result_processor
        for req, answer, _, _ in arrived:
            self.stats["transfers"] += 1
            for k in ("bytes", "kv_tokens", "seconds"):
                self.stats[k] += answer[k]
            for token in answer["output_ids"]:  # the prefill server's first token (checked below)
                processor.commit(req, token, check="none")
            req.cached_tokens = answer["cached_tokens"]
            self.sched.counters["num_generation_tokens_total"] += len(answer["output_ids"])
            if req.return_logprob:
                req.output_token_logprobs += answer["output_token_logprobs"]
                if req.top_logprobs_num:
                    req.output_top_logprobs += answer["output_top_logprobs"]
                if req.token_ids_logprob:
                    req.output_token_ids_logprobs += answer["output_token_ids_logprobs"]
            if processor.commit(req, None, check="full"):
                processor.release_finished(req)
                processor.send_finished([req])
            else:
                self.ready.append(req)

    def _on_chunk(self, msg: dict[str, Any], acks: list) -> None:
        """A staged chunk the prefill server wrote into a request's range: unpack it, then acknowledge
        (into `acks`: the prefill server writes the next one into the same range)."""
        key = str(msg["room"])
        entry = self.staged.get(key)
        if key not in self.transfers or entry is None:
            return  # given up (its prefill server was sent a cancel) or never staged here
        error = self.staging.receive(entry, msg.get("chunk"))
        if error is not None:  # held until the prefill server answers the cancel this sends
            self.sched.abort_with_status([entry.req], f"KV transfer from the prefill server failed: {error}", 500)
            return
        self.stats["staged_chunks"] += 1
        self.transfers[key] = (entry.req, self.ranks.clock(self.now))  # (the waiting timeout restarts)
        acks.append((entry.req, {"type": "chunk_ack", "room": key, "chunk": msg["chunk"]}))


def _read_done(msg: dict[str, Any]) -> dict[str, Any]:
    """A successful "done" answer's fields, typed; raises KeyError, TypeError or ValueError if any is
    malformed."""

    def pairs(v: Any) -> list[tuple[float, int]]:
        return [(_logprob(lp), int(t)) for lp, t in v]

    return {
        "output_ids": [int(t) for t in msg.get("output_ids", [])],
        "output_token_logprobs": pairs(msg.get("output_token_logprobs", [])),
        "output_top_logprobs": [pairs(top) for top in msg.get("output_top_logprobs", [])],
        "output_token_ids_logprobs": [pairs(c) for c in msg.get("output_token_ids_logprobs", [])],
        "cached_tokens": int(msg.get("cached_tokens", 0)),
        "bytes": int(msg.get("bytes", 0)),
        "kv_tokens": int(msg.get("kv_tokens", 0)),
        "seconds": float(msg.get("seconds", 0.0)),
    }


def _logprob(value: Any) -> float:
    """JSON has no -inf (orjson writes it, and NaN, as null)."""
    return float("-inf") if value is None else float(value)
