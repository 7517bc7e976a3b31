"""Who a PD server listens to on its control ports, and which prefill servers a decode server works with.

Messages (`channel.py`) are signed with HMAC-SHA256 under `SGLANG_DISAGGREGATION_SECRET`, which both
servers share: with it set, a message without the right signature is dropped, so no one without the
secret can end a room (`cancel`), answer a transfer (`done`) or make a server send to an address of their
choosing (a destination's `notify`). Without it the servers take anyone's messages, so they must listen
on loopback only (or be told the network is isolated: `SGLANG_DISAGGREGATION_ALLOW_UNAUTHENTICATED`).

A decode server sends its pools' addresses and slot ids to the prefill server a request names
(`bootstrap_host`), so it accepts only the prefill servers of `--disaggregation-prefill-allowlist`
(default: loopback), and, with the secret set, only once that server has answered a signed "hello"
(`PeerVerifier`): a listener a client named never gets more than the hello.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import re
import secrets
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from sglang.srt.environ import envs
from sglang.srt.server_args import ServerArgsError

if TYPE_CHECKING:
    from sglang.srt.server_args import ServerArgs

logger = logging.getLogger(__name__)

MAC_BYTES = hashlib.sha256().digest_size
# Separates these signatures from any other use of the same secret (a logit-processor secret, say).
_DOMAIN = b"sglang-disaggregation-v1\0"
_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.-]*[A-Za-z0-9])?$")
_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def secret() -> bytes | None:
    value = envs.SGLANG_DISAGGREGATION_SECRET.get()
    return value.encode() if value else None


def sign(key: bytes, body: bytes) -> bytes:
    """The frame on the wire: the signature, then the body."""
    return hmac.new(key, _DOMAIN + body, hashlib.sha256).digest() + body


def verify(key: bytes, frame: bytes) -> bytes | None:
    """The body of a frame signed with `key`, or None."""
    mac, body = frame[:MAC_BYTES], frame[MAC_BYTES:]
    want = hmac.new(key, _DOMAIN + body, hashlib.sha256).digest()
    return body if len(mac) == MAC_BYTES and hmac.compare_digest(mac, want) else None


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
    """Decode side, with the secret set: a prefill server proves it holds the secret (it answers a signed
    "hello" with its nonce, signed) before this server reserves anything for a request that names it.
    A listener a client named gets a hello and nothing else (no slot ids, no pool addresses), and its
    request holds nothing while it waits, so a client that leaves frees nothing late. Without the secret
    anyone could answer, so every peer counts as verified (loopback only, or an isolated network)."""

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

    def on_hello(self, msg: dict) -> bool:
        """A prefill server's answer; True if it verified a peer."""
        url, nonce = msg.get("to"), msg.get("nonce")
        entry = self.challenges.get(url) if isinstance(url, str) else None
        if entry is None or not isinstance(nonce, str) or not hmac.compare_digest(entry[0], nonce):
            return False
        del self.challenges[url]
        _bounded_put(self.proven, url, None, self.MAX_PEERS)
        return True


def hello_answer(msg: dict, host: str, port: int) -> dict | None:
    """Prefill side: the answer to a decode server's hello, or None when it was addressed to another
    server: a listener a client named could otherwise pass its hello on to this server and be verified
    by this server's answer. `host` and `port` are this server's --host and bootstrap port; where the
    hello's address or --host is a name (this server does not know its names), the port decides."""
    to, notify, nonce = msg.get("to"), msg.get("notify"), msg.get("nonce")
    if not all(isinstance(v, str) for v in (to, notify, nonce)) or not to.startswith("tcp://"):
        return None
    to_host, _, to_port = to[len("tcp://") :].rpartition(":")
    if to_port != str(port):
        return None
    to_ip, own = _ip(to_host), _ip(host)
    if to_ip is not None and own is not None and not own.is_unspecified and own != to_ip:
        return None
    return {"type": "hello", "room": "", "nonce": nonce, "to": to}


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def _bounded_put(d: dict, key: str, value: object, limit: int) -> None:
    d.pop(key, None)
    d[key] = value
    while len(d) > limit:
        d.pop(next(iter(d)))
