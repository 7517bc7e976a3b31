"""The control messages between a prefill and a decode server: JSON over ZMQ (never pickle: they cross
machines). The bytes of KV and state never go this way; they go through the transfer engine.

    decode -> prefill (to tcp://bootstrap_host:bootstrap_port)
        {"type": "dst", "room", "notify": decode's URL, "session": its transfer-engine session,
         "layout": PoolLayout, "kv": [token slot per prompt position], "slot": running slot}
        {"type": "cancel", "room", "notify"}     the decode side gave the request up
        {"type": "hello", "room": "", "nonce", "to": the URL it was sent to, "notify"}   (with the secret:
            before the first destination to a prefill server, which must answer it, `auth.PeerVerifier`)
    prefill -> decode (to "notify")
        {"type": "done", "room", "ok": true, "output_ids", "output_token_logprobs",
         "output_top_logprobs", "output_token_ids_logprobs", "cached_tokens", "bytes", "seconds"}
        {"type": "done", "room", "ok": false, "error": str}
        {"type": "hello", "room": "", "nonce", "to"}     the answer to a hello addressed to this server

Every "dst" gets exactly one "done" (ok or not) from a prefill server that is alive; a decode server
that gets none within SGLANG_DISAGGREGATION_WAITING_TIMEOUT gives the request up.

With SGLANG_DISAGGREGATION_SECRET set, every message is its HMAC then its JSON (`auth.sign`) and one
without the right signature is dropped. A receiver takes at most `max_message_bytes` per message (ZMQ
drops the connection of a peer that sends more) and at most MAX_MESSAGES_PER_POLL per scheduler step.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from typing import Any

import orjson
import zmq

from sglang.srt.disaggregation.auth import sign, verify

logger = logging.getLogger(__name__)

# Open PUSH sockets to peers at most (the least recently used one is closed to open another).
MAX_PEERS = 64
# Messages taken per scheduler step: a flood of them delays the step by at most this many parses
# (~7 us each, ~0.4 ms for a destination of a 4k-token prompt); the rest wait for the next step.
MAX_MESSAGES_PER_POLL = 256
# Between two warnings about dropped messages (a flood must not flood the log too).
_WARN_EVERY_S = 60.0


def reachable_host(host: str) -> str:
    """The address peers reach this server at: --host, or this machine's address when --host is a
    wildcard."""
    try:
        if not ipaddress.ip_address(host).is_unspecified:
            return host
    except ValueError:
        return host  # a name
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent; picks the outgoing interface
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


class Channel:
    """One PULL socket this server receives on, and PUSH sockets to peers (made on first use)."""

    def __init__(self, bind_host: str, port: int | None, secret: bytes | None, max_message_bytes: int):
        self.secret = secret
        self.dropped = 0  # messages refused: unsigned, badly signed, not JSON, not a message
        self._warned_at = float("-inf")
        self.ctx = zmq.Context(1)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if ":" in bind_host:
            self.pull.setsockopt(zmq.IPV6, 1)
        if port is None:
            port = self.pull.bind_to_random_port(tcp_url(bind_host, 0).rsplit(":", 1)[0])
        else:
            self.pull.bind(tcp_url(bind_host, port))
        self.port = port
        self.peers: dict[str, zmq.Socket] = {}  # least recently used first

    def send(self, url: str, msg: dict[str, Any]) -> bool:
        """Queue `msg` for `url` without blocking; False (and a warning) if the peer's queue is full."""
        sock = self.peers.pop(url, None)
        if sock is None:
            if len(self.peers) >= MAX_PEERS:  # peers come from clients' bootstrap fields: keep a bound
                self.peers.pop(next(iter(self.peers))).close()
            sock = self.ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(url)
        self.peers[url] = sock
        body = orjson.dumps(msg)
        try:
            sock.send(sign(self.secret, body) if self.secret else body, zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("Disaggregation: %s is not taking messages; %s for room %s dropped.",
                           url, msg.get("type"), msg.get("room"))  # fmt: skip
            return False

    def recv_all(self) -> list[dict[str, Any]]:
        out = []
        for _ in range(MAX_MESSAGES_PER_POLL):
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            body = verify(self.secret, raw) if self.secret else raw
            if body is None:
                self._drop("a message without a valid signature (both servers need the same "
                           "SGLANG_DISAGGREGATION_SECRET)")  # fmt: skip
                continue
            try:
                msg = orjson.loads(body)
            except orjson.JSONDecodeError:
                self._drop(
                    "a message that is not JSON (is SGLANG_DISAGGREGATION_SECRET set on one server only?)"
                )
                continue
            if isinstance(msg, dict) and isinstance(msg.get("type"), str) and "room" in msg:
                out.append(msg)
            else:
                self._drop("a message that is not a PD message")
        return out

    def _drop(self, what: str) -> None:
        self.dropped += 1
        now = time.monotonic()
        if now - self._warned_at >= _WARN_EVERY_S:
            self._warned_at = now
            logger.warning("Disaggregation: %s was dropped (%d dropped so far).", what, self.dropped)

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self.pull.close()
        self.ctx.term()
