"""The control messages between a prefill and a decode server: JSON over ZMQ (never pickle: they cross
machines). The bytes of KV and state never go this way; they go through the transfer engine.

    decode -> prefill (to tcp://bootstrap_host:bootstrap_port)
        {"type": "dst", "room", "rid", "notify": decode's URL, "session": its transfer-engine session,
         "layout": PoolLayout, "kv": [token slot per prompt position], "slot": running slot}
        {"type": "cancel", "room", "notify"}     the decode side gave the request up
    prefill -> decode (to "notify")
        {"type": "done", "room", "ok": true, "output_ids", "output_token_logprobs",
         "output_top_logprobs", "output_token_ids_logprobs", "cached_tokens", "bytes", "seconds"}
        {"type": "done", "room", "ok": false, "error": str}

Every "dst" gets exactly one "done" (ok or not) from a prefill server that is alive; a decode server
that gets none within SGLANG_DISAGGREGATION_WAITING_TIMEOUT gives the request up.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from typing import Any

import orjson
import zmq

logger = logging.getLogger(__name__)

# Open PUSH sockets to peers at most (the least recently used one is closed to open another).
MAX_PEERS = 64


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

    def __init__(self, bind_host: str, port: int | None):
        self.ctx = zmq.Context(1)
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
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
        try:
            sock.send(orjson.dumps(msg), zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("Disaggregation: %s is not taking messages; %s for room %s dropped.",
                           url, msg.get("type"), msg.get("room"))  # fmt: skip
            return False

    def recv_all(self) -> list[dict[str, Any]]:
        out = []
        while True:
            try:
                raw = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            try:
                msg = orjson.loads(raw)
            except orjson.JSONDecodeError:
                logger.warning("Disaggregation: a message that is not JSON was dropped.")
                continue
            if isinstance(msg, dict) and "type" in msg and "room" in msg:
                out.append(msg)

    def close(self) -> None:
        for sock in self.peers.values():
            sock.close()
        self.pull.close()
        self.ctx.term()
