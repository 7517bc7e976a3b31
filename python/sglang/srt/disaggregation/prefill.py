"""The prefill side of prefill/decode disaggregation (`--disaggregation-mode prefill`).

A request that carries a bootstrap room is prefilled as on any server (its own radix cache, every
mamba strategy, chunked prefill) and its first token sampled; then, instead of decoding, it waits in
the `PrefillBootstrapQueue` for the decode server's destination of that room (request slots and KV
token slots it reserved), its prompt's KV and running recurrent state are written there through the
transfer engine (on a worker thread; the scheduler goes on), the decode server is told the first token,
and the request finishes here: the tree keeps its prefix, and the reply (one token, the input logprobs
the router merges) goes to the router. Requests without a room are served whole, as on a plain server.

While a transfer reads a request's KV and state, what it holds is not freed, even if it is aborted:
the release waits for the transfer to end.

Under --tp-size N every rank runs this queue alike and writes its own shard into the decode server's
rank of the same index (at another --tp-size, its parts of the decode ranks' shards); rank 0 alone has
the bootstrap port and sends (`pd_ranks.py`).
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from sglang.srt.disaggregation.auth import BootstrapIdentity, check_at_start, secret
from sglang.srt.disaggregation.channel import MAX_ERROR_CHARS, Channel
from sglang.srt.disaggregation.destination import malformed_dst, unfit_dst
from sglang.srt.disaggregation.draft_state import stash_row_messages
from sglang.srt.disaggregation.pd_ranks import Outcome, PdRanks, rank_writes
from sglang.srt.disaggregation.shard_map import model_rule
from sglang.srt.disaggregation.staged_route import StagedRoute, staged_route
from sglang.srt.disaggregation.staging import ChunkLink
from sglang.srt.disaggregation.transfer import (
    Descriptor,
    PoolLayout,
    TransferError,
    open_transfer_engine,
)
from sglang.srt.disaggregation.weights_fingerprint import weights_total, with_weights
from sglang.srt.environ import envs

if TYPE_CHECKING:
    from sglang.srt.disaggregation.scheduler_view import DisaggScheduler
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


@dataclass
class _Room:
    since: float = field(default_factory=time.monotonic)  # (under TP, rank 0's clock: `PdRanks.clock`)
    req: Req | None = None  # prefilled, waiting for its destination or being transferred
    dst: dict[str, Any] | None = None  # the decode server's destination
    future: Future | None = None  # the transfer
    kv_tokens: int = 0  # prompt positions whose KV the transfer moves
    link: ChunkLink | None = None  # a staged transfer's chunks in flight (its cancel flag: `cancelled`)
    cancelled: threading.Event = field(default_factory=threading.Event)
    written: list = field(default_factory=list)  # the chunks this rank's thread wrote (staged)
    announced: int = 0  # of which the decode server was told (once every rank had written them)
    root_error: str | None = None  # the failure on one rank that stopped the others' (`PdRanks.exchange`)

    def cancel(self) -> None:
        """Stop this room's transfer: a direct one not begun writes nothing, a staged one stops at its
        next chunk (its wait for an acknowledgement wakes)."""
        self.cancelled.set()
        if self.link is not None:
            self.link.cancel()


class PrefillBootstrapQueue:
    def __init__(self, sched: DisaggScheduler):
        args = sched.server_args
        self.sched = sched
        check_at_start(args)
        # Under TP (`pd_ranks.py`): this server's ranks, whether rank 0 has messages and its clock.
        self.ranks = PdRanks.of_server(args)
        self.news = False  # (under TP: rank 0's channel holds messages, as this iteration's tick says)
        self.now = 0.0  # (under TP: rank 0's clock as of this iteration's tick or the last exchange)
        # Transfers run one at a time (one worker thread): the staging buffer holds one chunk.
        self.layout, self.engine, self.staging = open_transfer_engine(sched, "prefill")
        # Every rank's layout on every rank, so that each checks a destination alike.
        self.layouts = [PoolLayout.from_dict(d) for d in self.ranks.all_gather(self.layout.to_dict())]
        self.model_path: str | None = None  # the last /update_weights_from_disk's (`weights_changed`)
        self.decode_tp = args.disaggregation_decode_tp  # (upstream's flag: the decode servers' --tp-size)
        self.shard_rule = model_rule(sched)  # (what this model's ranks hold at a TP size: `check_targets`)
        self.context_len = sched.context_len
        # A destination names one token slot per prompt position: at most 11 bytes each in JSON, and the
        # rest (pool layouts, one per decode rank, and URLs) a few KB per rank.
        max_message = 64 * 1024 * max(8, 2 * self.ranks.tp_size) + 12 * self.context_len
        self.channel, self.identity = None, None  # (TP rank 0's only)
        if self.ranks.is_first:
            self.channel = Channel(
                args.host, args.disaggregation_bootstrap_port, secret(), max_message, "prefill"
            )
            self.identity = BootstrapIdentity(args.host, self.channel.port)
        # Destinations held for requests not received here yet (the decode server reserved first): at
        # most this many, naming at most 4x this server's KV pool in token slots (8 bytes each: at most
        # 32 bytes per token of the pool, which itself holds KB per token).
        self.max_unmatched = envs.SGLANG_DISAGGREGATION_MAX_UNMATCHED_ROOMS.get()
        self.max_unmatched_tokens = 4 * sched.token_allocator.size
        self.rooms: dict[str, _Room] = {}
        # Rooms whose request ended here without a transfer: a destination that comes later is answered
        # with an error at once (the decode server frees it).
        self.ended: dict[str, tuple[float, str]] = {}
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="kv-transfer")
        self.timeout = envs.SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT.get()
        self.stats = {"transfers": 0, "failed_transfers": 0, "bytes": 0, "kv_tokens": 0, "seconds": 0.0}
        if self.channel is not None:
            logger.info("Prefill server: bootstrap on port %d, transfers by %s.", self.channel.port,
                        args.disaggregation_transfer_backend)  # fmt: skip

    def _send(self, url: str, msg: dict[str, Any]) -> None:
        if self.ranks.is_first:
            self.channel.send(url, msg)

    def _layouts(self) -> list[PoolLayout]:
        return list(self.layouts) or [self.layout]

    # ---- the scheduler's hooks ----------------------------------------------------------------------

    def on_prefill_done(self, req: Req) -> None:
        """The prompt is prefilled and the first token sampled: hold the request until its transfer."""
        if req in self.sched.running:
            self.sched.running.remove(req)
        key = req.bootstrap.room
        if key in self.ended:
            self._abort(req, f"the decode server gave room {key} up", 503)
            return
        room = self.rooms.setdefault(key, _Room(self.ranks.clock(self.now)))
        if room.req is not None:
            self._abort(req, f"bootstrap_room {key} is already in use on this prefill server", 400)
            return
        room.req = req
        self._maybe_start(key, room)

    def defer_release(self, req: Req) -> bool:
        """An aborted request: True while a transfer still reads what it holds (released when the
        transfer ends); else its room is given up and it is released now."""
        room = self.rooms.get(req.bootstrap.room) if req.bootstrap else None
        if room is None or room.req is not req:
            return False
        if room.future is not None:
            return True
        room.req = None
        return False

    def on_released(self, req: Req) -> None:
        """A request with a room is gone (finished, aborted, refused): answer a destination waiting for it,
        and remember the room so that a later one is answered too."""
        if req.bootstrap is None or (req.finished_reason or {}).get("type") != "abort":
            return
        key = req.bootstrap.room
        room = self.rooms.get(key)
        if room is not None and room.req is not None and room.req is not req:
            return  # another request's room (this one was refused as a duplicate)
        if room is not None and room.future is None:
            del self.rooms[key]
            if room.dst is not None:
                self._notify_failed(room.dst, f"the prefill request ended: {req.finished_reason['message']}")
                return
        self._end(key, self.ranks.clock(self.now), req.finished_reason["message"])

    def busy(self) -> bool:
        return any(r.req is not None for r in self.rooms.values())

    def transfers_running(self) -> bool:
        return any(r.future is not None for r in self.rooms.values())

    def weights_changed(self, model_path: str | None = None, full: bool = True) -> None:
        """After a weight update, on every rank alike: every rank's layout names the new weights, which
        each destination's must match from now on (`PoolLayout.mismatch`); `full`: `with_weights`'."""
        self.model_path = model_path or self.model_path
        path = self.model_path or self.sched.server_args.model_path
        self.layout = with_weights(self.layout, self.sched, path, full)
        self.layouts = [PoolLayout.from_dict(d) for d in self.ranks.all_gather(self.layout.to_dict())]

    def has_news(self) -> bool:
        """TP rank 0, as it makes the scheduler's tick: whether its channel holds messages (the tick's
        `disagg`, which sets every rank's `news`, and `now` to rank 0's clock)."""
        return bool(self.channel.pull.poll(0))

    def poll(self) -> bool:
        """Take the decode servers' messages, start the transfers that can start, finish those that
        ended, and give up rooms past the bootstrap timeout. True if anything happened. Under TP every
        rank takes rank 0's messages and clock, and a transfer ends once every rank's has
        (`PdRanks.exchange`), so that every rank decides alike; with no room open and nothing on rank 0's
        channel (`news`, from the tick: every rank knows both alike) the ranks skip the exchange."""
        now = self.ranks.clock(self.now)  # (this iteration's tick's clock under TP: every rank's alike)
        for key, (since, _) in list(self.ended.items()):  # (idle too: no exchange need run to forget them)
            if now - since > self.timeout:
                del self.ended[key]
        if self.ranks.tp_size > 1 and not (self.rooms or self.news):
            return False
        first = None
        if self.ranks.is_first:
            msgs, other = [], False
            for msg in self.channel.recv_all():
                if msg["type"] == "hello":  # (rank 0's alone: its answer changes nothing here)
                    other = True
                    if answer := self.identity.hello_answer(msg):
                        self.channel.send(msg["notify"], answer)
                elif msg["type"] in ("dst", "cancel", "chunk_ack"):
                    msgs.append(msg)
                else:
                    other = True  # (taken and ignored)
            first = (msgs, time.monotonic(), other)
        ended = {
            key: _outcome(room.future)
            for key, room in self.rooms.items()
            if room.future is not None and room.future.done()
        }
        for room in self.rooms.values():  # (the chunks this rank's thread wrote; the last rides with done)
            if room.link is not None:
                room.written += room.link.drain()
                room.link.heartbeat()  # (not paused: the wait for an acknowledgement counts)
        (msgs, self.now, did), ended, failing = self.ranks.exchange(first, ended)
        for key, error in failing.items():  # failed on a rank: the ranks still running it stop
            room = self.rooms[key]
            room.root_error = room.root_error or error  # (the first failure gathered: every rank's alike)
            room.cancel()
        for msg in msgs:
            did = True
            if msg["type"] == "dst":
                self._on_dst(msg)
            elif msg["type"] == "cancel":
                self._on_cancel(msg)
            elif (room := self.rooms.get(str(msg["room"]))) and room.link:  # (every rank's thread)
                room.link.ack(msg.get("chunk"))
        staged = {key: len(room.written) for key, room in self.rooms.items() if room.link is not None}
        for key, count in (self.ranks.written_everywhere(staged) if staged else {}).items():
            room = self.rooms[key]
            for chunk in room.written[room.announced : count]:  # written by every rank: announced once
                did = True
                self._send(room.dst["notify"], {"type": "chunk", "room": key, "chunk": chunk})
            room.announced = max(room.announced, count)
        # (EAGLE / NEXTN: the first draft's g of every transfer that ended well, read in one call)
        done = [key for key, outcome in ended.items() if outcome[0] is None]
        reqs = [self.rooms[key].req for key in done]
        rows = dict(zip(done, stash_row_messages(self.sched, reqs, self.ranks.is_first), strict=True))
        for key, outcome in ended.items():
            did = True
            self._complete(key, self.rooms[key], outcome, rows.get(key, {}))
        return self._expire() or did

    # ---- rooms ---------------------------------------------------------------------------------------

    def _on_dst(self, msg: dict[str, Any]) -> None:
        key = str(msg["room"])
        problem = malformed_dst(msg, self.context_len)
        if problem is not None:
            logger.warning("Disaggregation: a malformed destination for room %s: %s.", key, problem)
            self._notify_failed(msg, f"a malformed destination ({problem})")
            return
        if key in self.ended:
            self._notify_failed(msg, f"the prefill request ended: {self.ended.pop(key)[1]}")
            return
        if key not in self.rooms:
            problem = self._unmatched_full(len(msg["kv"]))
            if problem is not None:
                logger.warning("Disaggregation: the destination for room %s was refused: %s.", key, problem)
                self._notify_failed(msg, problem)
                return
        room = self.rooms.setdefault(key, _Room(self.ranks.clock(self.now)))
        if room.dst is not None:
            self._notify_failed(msg, f"room {key} already has a destination")
            return
        msg["kv"] = array("q", msg["kv"])  # 8 bytes a slot while it waits, not a list's ~36
        room.dst = msg
        self._maybe_start(key, room)

    def _unmatched_full(self, tokens: int) -> str | None:
        waiting = [r.dst for r in self.rooms.values() if r.req is None and r.dst is not None]
        if len(waiting) >= self.max_unmatched:
            return (
                f"this prefill server already holds {len(waiting)} destinations for requests it has not "
                "received (SGLANG_DISAGGREGATION_MAX_UNMATCHED_ROOMS)"
            )
        held = sum(len(d["kv"]) for d in waiting)
        if held + tokens > self.max_unmatched_tokens:
            return (
                f"this prefill server already holds destinations of {held} token slots for requests it "
                f"has not received (at most {self.max_unmatched_tokens}, 4x its KV pool)"
            )
        return None

    def _on_cancel(self, msg: dict[str, Any]) -> None:
        key = str(msg["room"])
        room = self.rooms.get(key)
        if room is not None and room.future is not None:
            room.cancel()
            return  # the transfer's own answer frees the decode side
        # A prefilled request of this room that comes later is ended at once.
        self._end(key, self.ranks.clock(self.now), "the decode server gave the request up")
        if room is None:
            return
        del self.rooms[key]
        if room.dst is not None:
            self._notify_failed(room.dst, "cancelled by the decode server")
        if room.req is not None:
            self._abort(room.req, "the decode server gave the request up", 503)

    def _maybe_start(self, key: str, room: _Room) -> None:
        req, dst = room.req, room.dst
        if req is None or dst is None or room.future is not None:
            return
        n = len(req.origin_input_ids)
        # The prompt's prefix the decode server's radix cache holds already: its KV does not move.
        prefix = dst.get("prefix", 0)
        # (every rank checks every pair: all decide alike)
        problem = unfit_dst(self._layouts(), dst, n, self.staging is not None, self.decode_tp, self.shard_rule)
        if problem is not None:
            del self.rooms[key]
            self._notify_failed(dst, f"the transfer cannot be made: {problem}")
            self._abort(req, f"KV transfer to the decode server failed: {problem}", 500)
            return
        room.kv_tokens = n - prefix
        inject = _injected(req.rid, self.ranks.tp_rank)
        try:
            if self.staging is not None:  # (the decode ranks' staging ranges: `staged_route`)
                room.link = ChunkLink(room.cancelled)
                route = staged_route(self._layouts(), dst, self.ranks.tp_rank, self.staging)
                args = (route, req.kv_indices[prefix:n], req.mamba_pool_idx, room.link)
                room.future = self.executor.submit(self._transfer_staged, *args, inject)
                return
            # This rank's shard into the decode rank of the same index, or, where the two servers run
            # another --tp-size, the parts of the decode ranks' shards this rank holds (`rank_writes`:
            # up to ~0.8 s for a 131k-token prompt then, so it is built on the transfer thread).
            tokens = list(req.kv_indices[prefix:n])
            plan = partial(rank_writes, self._layouts(), dst, self.ranks.tp_rank, tokens, req.mamba_pool_idx)
        except Exception as e:  # noqa: BLE001 - what `malformed_dst` missed: refused, not raised
            # This rank's transfer fails at once; the room ends on every rank with this error in the
            # exchange (`PdRanks.exchange`), as any rank's failed write does.
            error = TransferError(f"the destination cannot be written ({type(e).__name__})")
            logger.warning("Disaggregation: room %s's destination cannot be written: %r.", key, e)
            room.future = Future()
            room.future.set_exception(error)
            return
        room.future = self.executor.submit(self._transfer, plan, inject, room.cancelled, key)

    def _transfer(
        self, plan: Callable[[], list[tuple[str, list[Descriptor]]]], inject: bool, cancelled: threading.Event,
        key: str = "",
    ) -> tuple[int, float]:
        """On the transfer thread: the writes `plan` gives, each (decode rank's session, copies) in turn
        (cancelled while it waited behind another: nothing is written, the decode side may have reused
        the destination). What `malformed_dst` missed fails the transfer, not the thread."""
        if cancelled.is_set():
            raise TransferError("cancelled by the decode server")
        if inject:
            raise TransferError("transfer failure injected by SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER")
        start, total, writes = time.perf_counter(), 0, None
        while True:
            try:  # (the writes are built as they are iterated: `rank_writes`)
                writes = iter(plan()) if writes is None else writes
                session, descriptors = next(writes, (None, None))
            except Exception as e:  # noqa: BLE001 - refused, not raised (the room ends with it on every rank)
                logger.warning("Disaggregation: room %s's destination cannot be written: %r.", key, e)
                raise TransferError(f"the destination cannot be written ({type(e).__name__})") from None
            if session is None:
                return total, time.perf_counter() - start
            if cancelled.is_set():  # (between two writes)
                raise TransferError("cancelled by the decode server")
            self.engine.write(session, descriptors)
            total += sum(n for _, _, n in descriptors)

    def _transfer_staged(
        self, route: StagedRoute, tokens: list[int], slot: int, link: ChunkLink, inject: bool
    ) -> tuple[int, float, list]:
        """On the transfer thread: the rows through the staging buffers, chunk by chunk (`Staging.send`);
        the last chunk goes with the answer."""
        if inject:
            raise TransferError("transfer failure injected by SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER")
        start = time.perf_counter()
        # An acknowledgement is one round trip and an unpack away; a decode server that sends none is gone.
        n, last = self.staging.send(self.engine.write, route, tokens, slot, link, min(self.timeout, 60))
        return n, time.perf_counter() - start, last

    def _complete(self, key: str, room: _Room, outcome: Outcome, draft_row: dict[str, Any]) -> None:
        """The transfer of `key` ended on every rank with `outcome` (`PdRanks.exchange`); `draft_row`: the
        answer's MTP stash row field (`stash_row_messages`; {} without EAGLE / NEXTN)."""
        del self.rooms[key]
        req, dst = room.req, room.dst
        e, nbytes, seconds, last_chunk = outcome
        if e is not None:  # any failure (on any rank) ends this request on both sides
            e = room.root_error or e
            self.stats["failed_transfers"] += 1
            logger.warning("KV transfer of room %s (%s) failed: %s", key, req, e)
            self._notify_failed(dst, f"KV transfer failed: {e}")
            if req.finished:  # aborted while the transfer ran
                self.sched.result_processor.release_finished(req)
            else:
                self._abort(req, f"KV transfer to the decode server failed: {e}", 500)
            return
        self.stats["transfers"] += 1
        self.stats["bytes"] += nbytes
        self.stats["kv_tokens"] += room.kv_tokens
        self.stats["seconds"] += seconds
        self._send(dst["notify"], {
            "type": "done", "room": key, "ok": True,
            "output_ids": req.output_ids,
            "output_token_logprobs": req.output_token_logprobs,
            "output_top_logprobs": req.output_top_logprobs,
            "output_token_ids_logprobs": req.output_token_ids_logprobs,
            "cached_tokens": req.cached_tokens,
            "bytes": nbytes, "kv_tokens": room.kv_tokens, "seconds": seconds,
            **({"chunk": last_chunk[0]} if last_chunk else {}),
            **draft_row,
        })  # fmt: skip
        processor = self.sched.result_processor
        if not req.finished:
            req.finished_reason = {"type": "length", "length": len(req.output_ids)}
            processor.release_finished(req)
            processor.send_finished([req])
        else:
            processor.release_finished(req)

    def _expire(self) -> bool:
        now = self.ranks.clock(self.now)
        did = False
        for key, room in list(self.rooms.items()):
            if room.future is None and now - room.since > self.timeout:
                did = True
                del self.rooms[key]
                if room.dst is not None:
                    self._notify_failed(room.dst, "the prefill server never got this request")
                    self._end(key, now, "the destination waited too long for this request")
                if room.req is not None:
                    message = f"no decode server sent a destination for room {key} within {self.timeout:g} s"
                    self._abort(room.req, message, 503)
        return did

    def _end(self, key: str, now: float, why: str) -> None:
        """Remember a room that ended here, for its other half; the oldest are forgotten past a bound (a
        cancel may name any room: then a late half waits for its timeout instead of ending at once)."""
        self.ended.pop(key, None)
        self.ended[key] = (now, why)
        while len(self.ended) > 4 * self.max_unmatched:
            self.ended.pop(next(iter(self.ended)))

    def _abort(self, req: Req, message: str, status_code: int) -> None:
        self.sched.abort_with_status([req], message, status_code)

    def _notify_failed(self, dst: dict[str, Any], error: str) -> None:
        if isinstance(dst.get("notify"), str):
            self._send(
                dst["notify"],
                {"type": "done", "room": str(dst["room"]), "ok": False, "error": error[:MAX_ERROR_CHARS]},
            )

    def state(self) -> dict[str, Any]:
        """For /get_server_info: the queues and the transfers so far (bytes, seconds on the transfer
        engine)."""
        return {
            "bootstrap_port": self.channel.port if self.channel is not None else None,
            "rooms": len(self.rooms),
            "waiting_for_destination": sum(
                1 for r in self.rooms.values() if r.req is not None and r.future is None
            ),
            "transferring": sum(1 for r in self.rooms.values() if r.future is not None),
            "dropped_messages": self.channel.dropped if self.channel is not None else 0,
            # Under TP what one request's transfer weighs on every rank together.
            "tp_size": self.ranks.tp_size,
            "weights_fingerprint": weights_total(self._layouts()),  # (the server's: every TP rank's share)
            **{k: sum(layout.sizes()[k] for layout in self._layouts()) for k in self.layout.sizes()},
            **self.stats,
        }

    def shutdown(self) -> None:
        self.executor.shutdown(wait=True)
        if self.channel is not None:
            self.channel.close()
        if hasattr(self.engine, "close"):
            self.engine.close()


def _injected(rid: str, tp_rank: int) -> bool:
    """Whether SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER=PREFIX fails this rank's transfer of `rid`: every
    rank's when `rid` starts with PREFIX, TP rank N's alone when with PREFIX + "rankN-"."""
    prefix = envs.SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER.get()
    if prefix is None or not rid.startswith(prefix):
        return False
    only = rid[len(prefix) :].partition("-")[0]
    return not (only.startswith("rank") and only[4:].isdigit()) or only == f"rank{tp_rank}"


def _outcome(future: Future) -> Outcome:
    """A transfer's outcome on this rank (its future has ended)."""
    try:
        nbytes, seconds, *last_chunk = future.result()
    except Exception as e:  # noqa: BLE001 - any failure ends the request: told, not raised
        return str(e), 0, 0.0, []
    return None, nbytes, seconds, last_chunk
