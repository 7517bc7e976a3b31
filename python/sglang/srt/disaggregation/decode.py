"""The decode side of prefill/decode disaggregation (`--disaggregation-mode decode`).

`DecodeTransferQueue`: a request that carries a bootstrap room first waits in the pre-allocation queue
until its destinations can be reserved (request row, running slot, KV slots for the prompt, keeping one
page free per running request so that they go on decoding); then the destination goes to the prefill
server named by the room's bootstrap host and port, and the request waits for that server's answer.
When the prompt's KV and state have arrived, the first token (sampled by the prefill server) is
committed and the request joins the running batch, decoding with the overlap schedule as any other. A
request aborted while a transfer may still write into what it holds keeps it until the prefill server
answers (or twice the waiting timeout passes). Requests without a room are served whole.

Under --tp-size N every rank runs this queue alike, each receiving its own shard (`pd_ranks.py`). The
handling of the prefill servers' answers ("done", "chunk") is in `decode_answers.py`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from sglang.srt.disaggregation.auth import PeerVerifier, PrefillAllowlist, check_at_start, secret
from sglang.srt.disaggregation.channel import Channel, answer_max_bytes, reachable_host, tcp_url
from sglang.srt.disaggregation.decode_answers import DecodeAnswers
from sglang.srt.disaggregation.decode_pool import HybridMambaDecodeReqToTokenPool  # noqa: F401 (re-export)
from sglang.srt.disaggregation.draft_state import draft_row_bytes
from sglang.srt.disaggregation.pd_ranks import PdRanks, destination_ranks
from sglang.srt.disaggregation.staging import StagedRange
from sglang.srt.disaggregation.state_packer import StatePacker
from sglang.srt.disaggregation.transfer import PoolLayout, clear_destination, open_transfer_engine
from sglang.srt.disaggregation.weights_fingerprint import weights_total, with_weights
from sglang.srt.environ import envs
from sglang.srt.mem_cache.common import alloc_for_extend

if TYPE_CHECKING:
    from sglang.srt.disaggregation.decode_answers import Arrived
    from sglang.srt.disaggregation.scheduler_view import DisaggScheduler
    from sglang.srt.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


class DecodeTransferQueue(DecodeAnswers):
    def __init__(self, sched: DisaggScheduler):
        args = sched.server_args
        self.sched = sched
        check_at_start(args)
        # Under TP (`pd_ranks.py`): this server's ranks, whether rank 0 has news and its clock; below,
        # every rank's session and layout (`rank_targets`), rank 0's clock at the first poll after each
        # room came (`added_at`), the rooms rank 0 could not send to (`unsent`).
        self.ranks = PdRanks.of_server(args)
        self.news = False  # (under TP: rank 0 has messages or unsent destinations, as the tick says)
        self.now = 0.0  # (under TP: rank 0's clock as of this iteration's tick or the last exchange)
        # Staged path: a staging buffer of fixed size, a range of at most one chunk per transfer in flight.
        self.layout, self.engine, self.staging = open_transfer_engine(sched, "decode")
        # Device pools registered directly are zeroed by tensor ops (no host address to memset).
        self.device_packer = None
        if self.staging is None and args.device != "cpu":
            self.device_packer = StatePacker.of(
                sched.model_runner.token_to_kv_pool, sched.req_to_token_pool.mamba_pool, args.device
            )
        self.staged: dict[str, StagedRange] = {}  # room -> its request's staging range
        self.allowlist = PrefillAllowlist.parse(args.disaggregation_prefill_allowlist)
        # Every rank's session and layout (rank 0 names them all in each destination).
        self.rank_targets = self._gather_targets()
        self.model_path: str | None = None  # the last /update_weights_from_disk's (`weights_changed`)
        self.channel, self.notify_url = None, ""  # (TP rank 0's only)
        if self.ranks.is_first:
            bound = answer_max_bytes(args.max_logprobs, draft_row_bytes(sched))
            self.channel = Channel(args.host, None, secret(), bound, "decode")
            self.notify_url = tcp_url(reachable_host(args.host), self.channel.port)
        self.peers = PeerVerifier(bool(secret()), self._channel_send, self.notify_url)
        self.added_at, self.unsent = {}, []
        self.prealloc: list[Req] = []  # waiting for destinations
        # --disaggregation-decode-enable-radix-cache: a prompt's prefix held by this server's tree is not
        # transferred again (the prefill server is told its length with the destination).
        self.radix = args.disaggregation_decode_enable_radix_cache and sched.tree_cache.supports_mamba()
        # Reserved, the destination not sent yet: (request, id of the newest batch launched at
        # reservation, length of the prompt's prefix this server's tree holds).
        self.reserved: list[tuple[Req, int, int]] = []
        self.transfers: dict[str, tuple[Req, float]] = {}  # destination sent: (request, since)
        self.ready: list[Req] = []  # transferred, waiting for a place in the running batch
        self.zombies: dict[str, tuple[Req, float]] = {}  # aborted while a transfer may still write
        self.dst_sent: set[str] = set()  # rooms whose prefill server was asked (it answers, or got a cancel)
        self.timeout = envs.SGLANG_DISAGGREGATION_WAITING_TIMEOUT.get()
        self.stats = {"transfers": 0, "failed_transfers": 0, "bytes": 0, "kv_tokens": 0, "seconds": 0.0,
                      "staged_chunks": 0}  # fmt: skip

    def _channel_send(self, url: str, msg: dict[str, Any]) -> bool:
        """Rank 0 sends; the other ranks' sends are dropped (as if sent)."""
        return self.channel.send(url, msg) if self.ranks.is_first else True

    # ---- the scheduler's hooks ----------------------------------------------------------------------

    def add(self, req: Req) -> None:
        if req.bootstrap.port is None:
            message = "bootstrap_port is null: give the router the prefill server's bootstrap port (--prefill URL PORT)."
            self.sched.abort_with_status([req], message, 400)
            return
        host, port = req.bootstrap.host, req.bootstrap.port
        if not self.allowlist.allows(host, port):
            message = (
                f"bootstrap_host {host!r} (bootstrap_port {port}) is not a prefill server this decode server "
                f"works with: --disaggregation-prefill-allowlist is {self.allowlist.text}."
            )
            self.sched.abort_with_status([req], message, 400, "bootstrap_host")
            return
        if req.bootstrap.room in self._rooms_in_use():
            self.sched.abort_with_status(
                [req], f"bootstrap_room {req.bootstrap.room} is already in use.", 400
            )
            return
        req.fill_ids = list(req.origin_input_ids)
        self.prealloc.append(req)  # (under TP its wait starts at the next poll: `poll`)

    def defer_release(self, req: Req) -> bool:
        """An aborted request: True if a transfer may still write into what it holds (released when the
        prefill server answers); else it leaves the queues and is released now."""
        key = req.bootstrap.room
        if key in self.transfers and self.transfers[key][0] is req:
            del self.transfers[key]
            self.zombies[key] = (req, self.ranks.clock(self.now) + 2 * self.timeout)
            self._send(req, {"type": "cancel", "room": key, "notify": self.notify_url})
            return True
        self.prealloc = [r for r in self.prealloc if r is not req]
        self.reserved = [e for e in self.reserved if e[0] is not req]
        self.ready = [r for r in self.ready if r is not req]
        return False

    def on_released(self, req: Req) -> None:
        """A request with a room ended here before its prefill server was asked for the transfer (refused,
        aborted while waiting): tell that server, which otherwise holds its half until its timeout."""
        entry = self.staged.get(req.bootstrap.room)
        if entry is not None and entry.req is req:  # nothing writes its staging range any more
            del self.staged[req.bootstrap.room]
            self.staging.free(entry.start)
        if self.ranks.tp_size > 1:
            self.added_at.pop(req.bootstrap.room, None)
        if req.bootstrap.port is None:
            return
        if (req.finished_reason or {}).get("type") != "abort":
            self.dst_sent.discard(req.bootstrap.room)
            return
        if req.bootstrap.room in self.dst_sent:
            self.dst_sent.discard(req.bootstrap.room)
            return  # the prefill server knows: it answered, or got a cancel
        self._send(req, {"type": "cancel", "room": req.bootstrap.room, "notify": self.notify_url})

    def busy(self) -> bool:
        return bool(self.prealloc or self.reserved or self.transfers or self.ready or self.zombies)

    def transfers_running(self) -> bool:
        return False  # transfers run on the prefill server; their answers wake the loop

    def _gather_targets(self) -> list[dict[str, Any]]:
        staging = self.staging.address(0) if self.staging is not None else None
        mine = {"session": self.engine.session_id, "layout": self.layout.to_dict(), "staging": staging}
        return self.ranks.all_gather(mine)

    def weights_changed(self, model_path: str | None = None, full: bool = True) -> None:
        """After a weight update, on every rank alike: the destinations sent from now on name the new
        weights, which the prefill server's must match (`PoolLayout.mismatch`); `full`: `with_weights`'."""
        self.model_path = model_path or self.model_path
        path = self.model_path or self.sched.server_args.model_path
        self.layout = with_weights(self.layout, self.sched, path, full)
        self.rank_targets = self._gather_targets()

    def has_news(self) -> bool:
        """TP rank 0, as it makes the scheduler's tick: whether its channel holds messages or it could
        not send a destination (the tick's `disagg`, which sets every rank's `news`, and `now` to rank 0's
        clock)."""
        return bool(self.unsent) or bool(self.channel.pull.poll(0))

    def poll(self) -> bool:
        """Under TP every rank takes rank 0's messages (its checks of hello acknowledgements come as
        "proven" URLs), its clock and the destinations it could not send (`PdRanks.exchange`), so
        that every rank decides alike; with no request in the queues and no news on rank 0 (`news`,
        from the tick: every rank knows both alike) the ranks skip the exchange."""
        if self.ranks.tp_size > 1 and not (self.news or self.busy()):
            return False
        first = None
        if self.ranks.is_first:
            msgs = []
            for msg in self.channel.recv_all():
                if msg["type"] in ("done", "chunk"):
                    msgs.append(msg)
                elif msg["type"] == "hello_ack" and self.peers.on_hello_ack(msg):
                    msgs.append({"type": "proven", "room": "", "url": msg["to"]})
            first = (msgs, time.monotonic(), list(self.unsent))
            self.unsent = []
        (msgs, self.now, unsent), _, _ = self.ranks.exchange(first, {})
        if self.ranks.tp_size > 1:  # requests added since the last poll wait from now (rank 0's clock)
            for req in self.prealloc:
                self.added_at.setdefault(req.bootstrap.room, self.now)
        did = bool(msgs or unsent)
        for key in unsent:
            self._drop_unsent(key)
        acks: list[tuple[Req, dict[str, Any]]] = []
        arrived: list[Arrived] = []
        for msg in msgs:
            if msg["type"] == "done":
                try:
                    self._on_done(msg, arrived)
                except (KeyError, TypeError, ValueError) as e:
                    logger.warning(
                        "Disaggregation: a malformed answer for room %r was dropped (%s).", msg["room"], e
                    )
            elif msg["type"] == "chunk":
                self._on_chunk(msg, acks)
            else:
                self.peers.mark_proven(msg["url"])
        if arrived:
            self._on_arrived(arrived)
        if acks:  # (every rank has unpacked its chunk before a prefill rank may write the next)
            self.ranks.barrier()
        for req, ack in acks:
            self._send(req, ack)
        did = self._expire() or did
        did = self._preallocate() or did
        did = self._send_destinations() or did
        return self._admit_ready() or did

    # ---- queues --------------------------------------------------------------------------------------

    def _rooms_in_use(self) -> set[str]:
        reqs = self.prealloc + [e[0] for e in self.reserved] + self.ready
        return {r.bootstrap.room for r in reqs} | set(self.transfers) | set(self.zombies)

    def _send(self, req: Req, msg: dict[str, Any]) -> bool:
        if not self.allowlist.allows(req.bootstrap.host, req.bootstrap.port):
            return False  # a refused request's cancel: nothing to tell a host this server never contacted
        if msg["type"] == "cancel" and not self.peers.verified(self._url(req)):
            return False  # it never got a destination from here: nothing to cancel
        return self._channel_send(self._url(req), msg)

    @staticmethod
    def _url(req: Req) -> str:
        return tcp_url(req.bootstrap.host, req.bootstrap.port)

    def _preallocate(self) -> bool:
        """Reserve destinations in arrival order, for requests whose prefill server proved itself (the
        others wait holding nothing, without holding up the rest)."""
        sched = self.sched
        did = False
        waiting: list[Req] = []
        blocked = False  # one waits for memory: the later ones wait behind it
        for req in self.prealloc:
            if not self.peers.ready(self._url(req)) or blocked:
                waiting.append(req)
                continue
            # One page per request that will decode before this one, so the running batch is not starved.
            reserve = len(sched.running) + len(self.ready) + len(self.transfers) + len(self.reserved) + 1
            n = len(req.origin_input_ids)
            p = self._match_prefix(req)
            start = None
            if self.staging is not None:
                start = self.staging.alloc(self.staging.range_bytes(n - p))
            if (self.staging is not None and start is None) or not alloc_for_extend(
                sched.tree_cache,
                sched.req_to_token_pool,
                sched.token_allocator,
                req,
                p,
                n,
                reserve_pages=reserve,
            ):
                req.kv_indices = []
                sched.tree_cache.release_match(req)
                if start is not None:  # (never written: still zeros)
                    self.staging.ranges.free(start)
                blocked = True
                waiting.append(req)
                continue
            did = True
            req.mamba_needs_clear = False  # cleared as its destination goes out; the transfer writes it
            req.cache_protected_len = p  # the tree's KV: its release keeps it, the transfer skips it
            req.mark_req_to_token_dirty(0)
            self.reserved.append((req, sched.num_batches, p))
            if start is not None:
                self.staged[req.bootstrap.room] = StagedRange(req, start, self.staging.range_bytes(n - p), p)
        self.prealloc = waiting
        return did

    def _match_prefix(self, req: Req) -> int:
        """With the decode radix cache: the prompt's prefix this server's tree holds, locked for `req`
        (`req.last_node`) and its KV slots in `req.kv_indices`; else 0. The match stops one token short of
        the prompt, so the transfer always carries the last token's KV. The checkpoint at the match is not
        copied (no COW): the running slot receives the state at the prompt's end from the prefill server,
        under every strategy."""
        req.kv_indices = []
        if not self.radix:
            return 0
        match = self.sched.tree_cache.match_prefix(req.origin_input_ids[:-1], req=req)
        req.mamba_branching_seqlen = None  # no extend runs here: nothing is tracked from the match
        req.kv_indices = list(match.device_indices)
        return len(req.kv_indices)

    def _send_destinations(self) -> bool:
        """Send the destinations whose slots no batch in flight can still write. A slot freed when a
        batch's result was processed may be written by the batch launched after it (overlap schedule);
        the forward stream orders that against later forwards, but not against the prefill server's
        transfer, which must wait until every batch launched before the reservation is processed."""
        processed = self.sched.processed_batch_id
        outgoing: list[tuple[Req, dict[str, Any]]] = []
        clears: list[tuple[list[int], int]] = []  # (device pools registered directly: zeroed together below)
        settle = getattr(self.sched.tree_cache, "settle_host_copies", None)  # (a host tier's copies)
        if settle is not None and self.reserved and self.reserved[0][1] <= processed:
            settle(self.sched.worker.call)  # before any destination is cleared: none may read it after
        while self.reserved and self.reserved[0][1] <= processed:
            req, _, prefix = self.reserved.pop(0)
            key = req.bootstrap.room
            # No batch writes these slots any more, and the transfer may only come after this. The
            # prefix's KV is the tree's (shared, never written by the transfer).
            msg = {
                "type": "dst", "room": key, "notify": self.notify_url,
                "session": self.engine.session_id, "layout": self.layout.to_dict(),
                "prefix": prefix, "kv": req.kv_indices[prefix:], "slot": req.mamba_pool_idx,
            }  # fmt: skip
            staged = None
            if key in self.staged:  # the unpack writes every row; its range holds zeros (`Staging.alloc`)
                entry = self.staged[key]
                msg["staging"], msg["staging_bytes"] = self.staging.address(entry.start), entry.length
                staged = (entry.start, entry.length)
            elif self.device_packer is not None:
                clears.append((req.kv_indices[prefix:], req.mamba_pool_idx))
            else:
                clear_destination(self.layout, req.kv_indices[prefix:], req.mamba_pool_idx)
            outgoing.append((req, msg | destination_ranks(self.rank_targets, staged)))
        if clears:  # one copy-stream wait for the poll's destinations, done before the first is sent
            self.device_packer.clear_many(clears)
        if outgoing:
            self.ranks.barrier()  # (under TP: every rank's destination is cleared before any is asked)
        for req, msg in outgoing:
            key = msg["room"]
            sent = self._send(req, msg)
            if not sent and self.ranks.tp_size == 1:  # nothing can write into it: release at once
                self.sched.abort_with_status([req], "The prefill server does not take messages.", 503)
                continue
            if not sent:  # (rank 0 alone knows: every rank releases it at the next poll)
                self.unsent.append(key)
            self.dst_sent.add(key)
            self.transfers[key] = (req, self.ranks.clock(self.now))
        return bool(outgoing)

    def _drop_unsent(self, key: str) -> None:
        """Under TP, a destination rank 0 could not send: nothing can write into it, release it."""
        self.dst_sent.discard(key)
        if key in self.zombies:  # (aborted meanwhile)
            self.sched.result_processor.release_finished(self.zombies.pop(key)[0])
        elif key in self.transfers:
            req, _ = self.transfers.pop(key)
            self.sched.abort_with_status([req], "The prefill server does not take messages.", 503)

    def _admit_ready(self) -> bool:
        sched = self.sched
        admitted = []
        while self.ready and len(sched.running) < sched.max_running_requests:
            req = self.ready.pop(0)
            sched.running.append(req)
            admitted.append(req)
        if admitted:
            sched.result_processor.stream_output(admitted)
        return bool(admitted)

    def _expire(self) -> bool:
        now = self.ranks.clock(self.now)
        did = False
        came = self.added_at.get  # (under TP on rank 0's clock: every rank's own would differ)
        for req in [r for r in self.prealloc if now - came(r.bootstrap.room, r.created_time) > self.timeout]:
            if not self.peers.ready(self._url(req)):
                did = True
                message = (
                    f"the prefill server at {self._url(req)} did not answer within {self.timeout:g} s "
                    "(is it up, with the same SGLANG_DISAGGREGATION_SECRET?)"
                )
                self.sched.abort_with_status([req], message, 503)
        for key, (req, since) in list(self.transfers.items()):
            if now - since > self.timeout:
                did = True
                message = f"the prefill server transferred nothing for room {key} within {self.timeout:g} s"
                self.sched.abort_with_status([req], message, 503)  # held until its answer or deadline
        for key, (req, deadline) in list(self.zombies.items()):
            if now > deadline:
                did = True
                del self.zombies[key]
                logger.warning("Room %s: no answer from the prefill server; %s's slots are freed.", key, req)
                self.sched.result_processor.release_finished(req)
        return did

    def state(self) -> dict[str, Any]:
        """For /get_server_info: the queues and the transfers so far (bytes, seconds on the transfer
        engine)."""
        layouts = [PoolLayout.from_dict(t["layout"]) for t in self.rank_targets] or [self.layout]
        return {
            "tp_size": self.ranks.tp_size,
            "prealloc_queue": len(self.prealloc) + len(self.reserved),
            "transfer_queue": len(self.transfers),
            "ready": len(self.ready),
            "aborted_holding": len(self.zombies),
            "staging_ranges": self.staging.in_use() if self.staging is not None else 0,
            "staging_buffer_bytes": self.staging.buffer.nbytes if self.staging is not None else 0,
            "staging_chunk_bytes": self.staging.chunk_bytes if self.staging is not None else 0,
            "dropped_messages": self.channel.dropped if self.channel is not None else 0,
            "decode_radix_cache": self.radix,
            "weights_fingerprint": weights_total(layouts),  # (the server's: every TP rank's share)
            # As on the prefill side: what one request's transfer weighs on every rank together (the
            # staging sizes above are one rank's buffer: every rank has one alike).
            **{k: sum(layout.sizes()[k] for layout in layouts) for k in self.layout.sizes()},
            **self.stats,
        }

    def shutdown(self) -> None:
        if self.channel is not None:
            self.channel.close()
        if hasattr(self.engine, "close"):  # (NIXL: its progress thread stops)
            self.engine.close()
