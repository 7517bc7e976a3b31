"""Who a PD server listens to on its control ports, and which prefill servers a decode server works with.

Messages (`channel.py`) are signed with HMAC-SHA256 under `SGLANG_DISAGGREGATION_SECRET`, which both
servers share: with it set, a message without the right signature is dropped, so no one without the
secret can end a room (`cancel`), answer a transfer (`done`) or make a server send to an address of their
choosing (a destination's `notify`). Without it the servers take anyone's messages, so they must listen
on loopback only (or be told the network is isolated: `SGLANG_DISAGGREGATION_ALLOW_UNAUTHENTICATED`).

Each direction signs under its own label (decode -> prefill, prefill -> decode) and a server takes only
the other direction's messages, so a message sent back to the server that signed it is dropped; the type
is in the signed body, so no message passes for another kind.

A decode server sends its pools' addresses and slot ids to the prefill server a request names
(`bootstrap_host`), so it accepts only the prefill servers of `--disaggregation-prefill-allowlist`
(default: loopback), and, with the secret set, only once that server has acknowledged a signed "hello"
(`PeerVerifier`) with a "hello_ack". A prefill server acknowledges only hellos addressed to itself
(`BootstrapIdentity`), so a listener a client named never gets more than the hello, whether it sends the
hello back or passes it on to a real prefill server.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal

from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgsError

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

Role = Literal["decode", "prefill"]

MAC_BYTES = hashlib.sha256().digest_size
# Signed before each body: separates these signatures from any other use of the secret (a logit-processor
# secret, say) and the two directions from each other.
_DOMAINS: dict[str, bytes] = {
    "decode": b"sglang-disaggregation-v2\0decode->prefill\0",
    "prefill": b"sglang-disaggregation-v2\0prefill->decode\0",
}
PEER_ROLE: dict[str, Role] = {"decode": "prefill", "prefill": "decode"}
_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def secret() -> bytes | None:
    value = envs.SGLANG_DISAGGREGATION_SECRET.get()
    return value.encode() if value else None


def _mac(key: bytes, sender: Role, body: bytes | memoryview) -> bytes:
    mac = hmac.new(key, _DOMAINS[sender], "sha256")
    mac.update(body)  # a view: the body is never copied
    return mac.digest()


def sign(key: bytes, body: bytes, sender: Role) -> bytes:
    """The frame on the wire: the signature (as `sender`'s direction), then the body."""
    return _mac(key, sender, body) + body


def verify(key: bytes, frame: bytes | memoryview, sender: Role) -> memoryview | None:
    """The body of a frame that `sender`'s side signed with `key` (a view into `frame`), or None."""
    view = memoryview(frame)
    if len(view) < MAC_BYTES:
        return None
    body = view[MAC_BYTES:]
    return body if hmac.compare_digest(view[:MAC_BYTES], _mac(key, sender, body)) else None


def is_loopback(host: str) -> bool:
    address = _ip(host)
    return host.lower() == "localhost" or (address is not None and address.is_loopback)


def security_problem(args: ServerArgs) -> str | None:
    """At startup: a PD server on a reachable address needs the secret (or the operator's word that the
    network is isolated), and the allowlist must parse. One sentence, or None."""
    if args.disaggregation_mode == "null":
        return None
    try:
        PrefillAllowlist.parse(args.disaggregation_prefill_allowlist)
    except ValueError as e:
        return str(e)
    if (
        secret() is None
        and not is_loopback(args.host)
        and not envs.SGLANG_DISAGGREGATION_ALLOW_UNAUTHENTICATED.get()
    ):
        return (
            f"--disaggregation-mode {args.disaggregation_mode} with --host {args.host} takes control messages "
            "from the network: set the same SGLANG_DISAGGREGATION_SECRET on the prefill and decode servers, "
            "or SGLANG_DISAGGREGATION_ALLOW_UNAUTHENTICATED=1 on an isolated network (docs/disaggregation.md)."
        )
    return None


def check_at_start(args: ServerArgs) -> None:
    """The PD queues' first step: refuse (one sentence) or warn about how this server is reachable."""
    if (problem := security_problem(args)) is not None:
        raise ServerArgsError(problem)
    if secret() is None:
        logger.warning(
            "Disaggregation: SGLANG_DISAGGREGATION_SECRET is not set, so any process that reaches this "
            "server's PD ports can end its transfers or answer them; set the same secret on both servers."
        )


class PrefillAllowlist:
    """The prefill servers (host, host:port, or an IP network, with or without a port) a decode server
    sends destinations to. Hosts are compared as written (no name lookup): list them as the router's
    --prefill URLs name them."""

    DEFAULT = ("127.0.0.0/8", "::1", "localhost")

    def __init__(self, entries: list[tuple[str | _Network, int | None]], text: str):
        self.entries = entries
        self.text = text

    @classmethod
    def parse(cls, values: list[str] | None) -> PrefillAllowlist:
        items = [s.strip() for v in (values or cls.DEFAULT) for s in v.split(",") if s.strip()]
        entries = []
        for item in items:
            try:
                entries.append(_parse_entry(item))
            except ValueError:
                raise ValueError(
                    f"--disaggregation-prefill-allowlist: {item!r} is not host, host:port, [IPv6]:port or an "
                    "IP network (10.0.0.0/24) with an optional port."
                ) from None
        return cls(entries, ",".join(items))

    def allows(self, host: str, port: int | None) -> bool:
        address = _ip(host)
        for want, want_port in self.entries:
            if want_port is not None and want_port != port:
                continue
            if isinstance(want, str):
                if want == host.lower():
                    return True
            elif address is not None and address in want:
                return True
        return False


def _parse_entry(item: str) -> tuple[str | _Network, int | None]:
    port = None
    host = item
    if item.startswith("["):
        host, sep, rest = item[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError(item)
        port = int(rest[1:]) if rest else None
    elif item.count(":") == 1:
        host, raw = item.split(":")
        port = int(raw)
    if port is not None and not 0 < port < 65536:
        raise ValueError(item)
    try:
        return ipaddress.ip_network(host, strict=False), port
    except ValueError:
        if not _HOST_NAME.match(host):
            raise
        return host.lower(), port


class PeerVerifier:
    """Decode side, with the secret set: a prefill server proves it holds the secret (it acknowledges a
    signed "hello" with its nonce, signed the other way) before this server reserves anything for a
    request that names it. A listener a client named gets a hello and nothing else (no slot ids, no pool
    addresses), and its request holds nothing while it waits, so a client that leaves frees nothing
    late. Without the secret anyone could answer, so every peer counts as verified (loopback only, or an
    isolated network)."""

    RETRY_S = 1.0  # a prefill server still starting gets a hello again this often
    MAX_PEERS = 1024  # verified and challenged URLs kept (URLs come from clients: keep a bound)

    def __init__(self, enabled: bool, send: Callable[[str, dict], bool], notify_url: str):
        self.enabled = enabled
        self.send = send
        self.notify_url = notify_url
        self.proven: dict[str, None] = {}  # oldest first
        self.challenges: dict[str, tuple[str, float]] = {}  # url -> (nonce, sent at)

    def verified(self, url: str) -> bool:
        return not self.enabled or url in self.proven

    def ready(self, url: str) -> bool:
        """True once `url` answered; else (re)sends its hello and says False."""
        if not self.enabled or url in self.proven:
            return True
        now = time.monotonic()
        _, sent = self.challenges.get(url, ("", float("-inf")))
        if now - sent >= self.RETRY_S:
            nonce = secrets.token_hex(16)
            _bounded_put(self.challenges, url, (nonce, now), self.MAX_PEERS)
            self.send(
                url, {"type": "hello", "room": "", "nonce": nonce, "to": url, "notify": self.notify_url}
            )
        return False

    def on_hello_ack(self, msg: dict) -> bool:
        """A prefill server's acknowledgement; True if it verified a peer. It must name the URL this
        server addressed with that nonce: the prefill server checked that the URL is its own."""
        url, nonce = msg.get("to"), msg.get("nonce")
        if msg.get("type") != "hello_ack":
            return False
        entry = self.challenges.get(url) if isinstance(url, str) else None
        if entry is None or not isinstance(nonce, str) or not hmac.compare_digest(entry[0], nonce):
            return False
        del self.challenges[url]
        self.mark_proven(url)
        return True

    def mark_proven(self, url: str) -> None:
        """`url` proved itself (to TP rank 0, which alone sends hellos: the other ranks learn it so)."""
        _bounded_put(self.proven, url, None, self.MAX_PEERS)


class BootstrapIdentity:
    """Prefill side: which hellos this server acknowledges. Only those addressed to itself: its bootstrap
    port, and a host that is one of its own addresses (--host when it is one; with a wildcard --host,
    any address of this machine; with a name, what it resolves to), or a name that resolves to one (on
    a thread: the hello is acknowledged when the decode server sends it again). A loopback address is
    this server only for a hello that came over loopback. So a listener a client named that passes its
    hello on (or a process on the decode server's machine posing as a loopback prefill server) is not
    acknowledged, whatever --host is."""

    MAX_NAMES = 256  # names looked up and kept (they come from signed hellos, but keep a bound)

    def __init__(self, host: str, port: int):
        self.port = port
        own = _ip(host)
        self.wildcard = own is not None and own.is_unspecified
        self.dual_stack = self.wildcard and own.version == 6
        if own is not None:
            self.addresses = {own}
        else:  # a name: ZMQ bound to what it resolves to
            self.addresses = set(_resolve(host))
        self._names: dict[str, _Lookup] = {}

    def hello_answer(self, msg: dict) -> dict | None:
        """The acknowledgement of a decode server's hello, or None (not addressed to this server, not
        known yet, or malformed). `msg["peer"]` is the sender's address as the socket saw it."""
        to, notify, nonce, peer = msg.get("to"), msg.get("notify"), msg.get("nonce"), msg.get("peer")
        if not all(isinstance(v, str) for v in (to, notify, nonce)) or not to.startswith("tcp://"):
            return None
        to_host, _, to_port = to[len("tcp://") :].rpartition(":")
        if to_port != str(self.port):
            return None
        to_ip = _ip(to_host)
        if to_ip is not None:
            candidates = [to_ip]
        else:
            candidates = self._lookup(to_host.lower())
        from_loopback = isinstance(peer, str) and (address := _ip(peer)) is not None and address.is_loopback
        if not any(self._is_own(a, from_loopback) for a in candidates or ()):
            return None
        return {"type": "hello_ack", "room": "", "nonce": nonce, "to": to}

    def _is_own(self, address: _Address, from_loopback: bool) -> bool:
        if address.is_unspecified or address.is_multicast:
            return False
        if address.is_loopback and not from_loopback:
            return False  # the decode server's own loopback: a process on its machine, not this server
        if not self.wildcard:
            return address in self.addresses
        # 0.0.0.0 takes IPv4 only; :: (ZMQ_IPV6) takes both.
        return (address.version == 4 or self.dual_stack) and _is_local(address)

    def _lookup(self, name: str) -> list[_Address] | None:
        entry = self._names.get(name)
        if entry is None:
            entry = _Lookup()
            _bounded_put(self._names, name, entry, self.MAX_NAMES)
            threading.Thread(target=entry.run, args=(name,), daemon=True, name="pd-resolve").start()
        return entry.addresses


class _Lookup:
    addresses: list[_Address] | None = None  # None until resolved

    def run(self, name: str) -> None:
        self.addresses = _resolve(name)


def _resolve(name: str) -> list[_Address]:
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return []
    return [a for info in infos if (a := _ip(str(info[4][0]).split("%")[0])) is not None]


def _is_local(address: _Address) -> bool:
    """Whether `address` belongs to this machine: only then can a socket bind to it."""
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.bind((str(address), 0))
            return True
        except OSError:
            return False


def _ip(host: str) -> _Address | None:
    try:
        address = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None
    # A dual-stack socket reports an IPv4 peer as ::ffff:a.b.c.d.
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address


def _bounded_put(d: dict, key: str, value: object, limit: int) -> None:
    d.pop(key, None)
    d[key] = value
    while len(d) > limit:
        d.pop(next(iter(d)))
