"""The control messages between a prefill and a decode server: JSON over ZMQ (never pickle: they cross
machines). The bytes of KV and state never go this way; they go through the transfer engine.

    decode -> prefill (to tcp://bootstrap_host:bootstrap_port)
        {"type": "dst", "room", "notify": decode's URL, "session": its transfer-engine session,
         "layout": PoolLayout, "prefix": prompt positions its radix cache holds (0 without one),
         "kv": [token slot per prompt position from prefix on], "slot": running slot}
        {"type": "cancel", "room", "notify"}     the decode side gave the request up
        {"type": "hello", "room": "", "nonce", "to": the URL it was sent to, "notify"}   (with the secret:
            before the first destination to a prefill server, which must acknowledge it, `auth.PeerVerifier`)
    prefill -> decode (to "notify")
        {"type": "done", "room", "ok": true, "output_ids", "output_token_logprobs",
         "output_top_logprobs", "output_token_ids_logprobs", "cached_tokens", "bytes", "kv_tokens", "seconds"}
        {"type": "done", "room", "ok": false, "error": str}
        {"type": "hello_ack", "room": "", "nonce", "to"}   the answer to a hello addressed to this server
    staged path (`staging.py`): "dst" also names "staging" (its range's address) and "staging_bytes";
    prefill -> decode {"type": "chunk", "room", "chunk": [start, end, with state]} for each chunk but
    the last (which comes with "done", as "chunk"); decode -> prefill {"type": "chunk_ack", "room",
    "chunk"} once it is unpacked

Every "dst" gets exactly one "done" (ok or not) from a prefill server that is alive; a decode server
that gets none within SGLANG_DISAGGREGATION_WAITING_TIMEOUT gives the request up.

With SGLANG_DISAGGREGATION_SECRET set, every message is its HMAC (under its direction's label) then its
JSON (`auth.sign`), and one without the right signature is dropped. A receiver takes at most
`max_message_bytes` per message (ZMQ drops the connection of a peer that sends more), and per scheduler
step at most MAX_MESSAGES_PER_POLL messages and, past MAX_BYTES_PER_POLL, no further message: the
scheduler thread checks a flood's junk at most that many bytes (plus one message) a step, each byte
once (no copies: the signature and the parse read ZMQ's buffer).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import time
from typing import Any

import orjson
import zmq

from sglang.srt.disaggregation.auth import PEER_ROLE, Role, sign, verify

logger = logging.getLogger(__name__)

# Open PUSH sockets to peers at most (the least recently used one is closed to open another).
MAX_PEERS = 64
# Messages taken per scheduler step: a flood of small ones delays the step by at most this many parses
# (~3 us for an answer, ~80 us for a destination of a 4k-token prompt); the rest wait for the next step.
MAX_MESSAGES_PER_POLL = 256
# Bytes after which a step takes no further message: a flood of large ones delays the step by at most
# this much (plus one message) checked, ~0.6 ms a MB signed and ~1 ms a MB of junk parsed
# (docs/disaggregation.md), where 256 of the decode side's former 9.8 MB bound took seconds. Still
# hundreds of answers or 4k-token destinations a step.
MAX_BYTES_PER_POLL = 1 << 20
# One [logprob, token id] entry of an answer in JSON: a float's longest repr (24), an id (10), brackets
# and commas; rounded up.
LOGPROB_ENTRY_BYTES = 48
# An answer's error text is cut to this many characters (at most 6 bytes each in JSON).
MAX_ERROR_CHARS = 4096
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


def answer_max_bytes(max_logprobs: int, draft_row_bytes: int = 0) -> int:
    """The decode side's bound on a message: an answer carries the first token's logprobs, one position
    (its top list and its chosen ids, each at most --max-logprobs long, as the decode server checked the
    request), an error cut to MAX_ERROR_CHARS, and with EAGLE / NEXTN the MTP output row of
    `draft_row_bytes` bytes in base64 (`draft_state.py`); the rest is well under 64 KiB."""
    return 64 * 1024 + 2 * LOGPROB_ENTRY_BYTES * max_logprobs + 4 * -(-draft_row_bytes // 3)


def tcp_url(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _peer_address(frame: zmq.Frame) -> str | None:
    try:
        return frame.get("Peer-Address")
    except zmq.ZMQError:  # (a transport without one)
        return None


class Channel:
    """One PULL socket this server receives on, and PUSH sockets to peers (made on first use). `role`
    is this server's side: it signs as that side and takes only the other side's messages."""

    def __init__(
        self, bind_host: str, port: int | None, secret: bytes | None, max_message_bytes: int, role: Role
    ):
        self.secret = secret
        self.role = role
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
            sock.send(sign(self.secret, body, self.role) if self.secret else body, zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("Disaggregation: %s is not taking messages; %s for room %s dropped.",
                           url, msg.get("type"), msg.get("room"))  # fmt: skip
            return False

    def recv_all(self) -> list[dict[str, Any]]:
        """The messages waiting, as many as this step takes. Each has "peer": the sender's address as
        the socket saw it (set here, whatever the sender wrote)."""
        out = []
        taken = 0
        for _ in range(MAX_MESSAGES_PER_POLL):
            if taken >= MAX_BYTES_PER_POLL:
                break  # the rest stay queued (the socket stays readable, so the loop comes back)
            try:
                frame = self.pull.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                break
            raw = frame.buffer
            taken += len(raw)
            body = verify(self.secret, raw, PEER_ROLE[self.role]) if self.secret else raw
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
                msg["peer"] = _peer_address(frame)
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
