"""Fetching an http(s) media URL of a request, within bounds a client cannot stretch:
- one deadline for the whole fetch, set when the request's reading started and covering the wait for a
  fetch thread, name resolution (a resolver slower than the deadline is left running in a thread of its
  own, until the system resolver's timeouts), every redirect, the headers and the body; when it
  passes, the connection is shut down under the reading thread, whatever the server trickles;
- a byte limit checked against Content-Length and while streaming: the body is read in pieces and the
  fetch ends as soon as it holds one byte over the limit;
- at most `max_redirects` redirects, each destination checked as the first URL;
- SSRF: without --allowed-media-domains, a host is fetched only when every address it resolves to is
  public (not loopback, private, link-local, CGNAT, multicast or reserved, nor an IPv6 address that
  embeds such an IPv4 one: mapped, compatible, NAT64, 6to4); with it, only the hosts it
  names, at whatever address. The connection goes to the address checked (a DNS answer that changes
  between the check and the connect is not used), without proxies, and https verifies the certificate
  for the host name.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
import threading
import time
import urllib.parse
from dataclasses import dataclass, field

from sglang.srt.managers.request_validation import RequestError
from sglang.srt.server_args_media import normalize_host

REDIRECTS = (301, 302, 303, 307, 308)
READ_BYTES = 64 << 10
# The most bytes all of one request's URLs (and an HTTP client's files) may hold together: without it,
# 32 images of 64 MiB each (the defaults) would let one request hold 2 GiB; nor would a video's list of
# frames, read before its frame count is checked, be bounded. 256 MiB: 32 images of 8 MiB.
MAX_BYTES_PER_REQUEST = 256 << 20


class ByteBudget:
    """The bytes one request's reads may still take (shared by its reading threads)."""

    def __init__(self, limit: int | None = None):
        self.limit = MAX_BYTES_PER_REQUEST if limit is None else limit
        self.left = self.limit
        self._lock = threading.Lock()

    def take(self, n: int) -> bool:
        with self._lock:
            self.left -= n
            return self.left >= 0


class FetchScope:
    """The running fetches of one request, cut together when the request fails (a refusal of one of
    its items, or the client gone): they do not hold their threads until their deadline."""

    def __init__(self):
        self._lock = threading.Lock()
        self._live: set = set()
        self.cancelled = False

    def add(self, conn) -> bool:
        with self._lock:
            if not self.cancelled:
                self._live.add(conn)
            return not self.cancelled

    def discard(self, conn) -> None:
        with self._lock:
            self._live.discard(conn)

    def cancel(self) -> None:
        with self._lock:
            self.cancelled = True
            live = list(self._live)
        for conn in live:
            conn.cut()


def default_timeout_s() -> float:
    """Upstream SGLang's REQUEST_TIMEOUT environment variable (seconds) names the fetch's time; here it
    is the deadline of all of a request's URLs (upstream: each socket read). Default 10 s."""
    import os

    raw = os.environ.get("REQUEST_TIMEOUT")
    try:
        value = float(raw) if raw else 10.0
    except ValueError:
        raise ValueError(
            f"Environment variable REQUEST_TIMEOUT={raw!r} is not a number of seconds."
        ) from None
    if value <= 0:
        raise ValueError(f"Environment variable REQUEST_TIMEOUT={raw!r} must be positive.")
    return value


@dataclass(frozen=True)
class FetchPolicy:
    # Exact host names URLs may name (`normalize_host` form); empty: any host with public addresses.
    allowed_domains: frozenset[str] = frozenset()
    # Most bytes one URL may send; None: no limit (--media-url-max-file-size-mb 0).
    max_bytes: int | None = 64 << 20
    timeout_s: float = field(default_factory=default_timeout_s)
    max_redirects: int = 5


def is_url(item: object) -> bool:
    return isinstance(item, str) and item[:8].lower().startswith(("http://", "https://"))


def fetch_url(
    url: str,
    where: str,
    param: str,
    policy: FetchPolicy,
    deadline: float,
    budget: ByteBudget | None = None,
    scope: FetchScope | None = None,
) -> bytes:
    """The body of `url` (200 after at most `max_redirects` redirects), or a RequestError naming `param`.
    `budget`: the request's bytes, shared with its other fetches; `scope`: its running fetches."""
    budget = budget or ByteBudget()
    for _ in range(policy.max_redirects + 1):
        if time.monotonic() >= deadline:
            raise _timeout(where, param, policy)
        parts, host, port, address = _destination(url, where, param, policy, deadline)
        status, location, body = _get(
            parts, host, port, address, where, param, policy, deadline, budget, scope
        )
        if status == 200:
            return body
        if status not in REDIRECTS:
            raise RequestError(f"{where}: the URL answered HTTP {status}.", param)
        if not location:
            raise RequestError(f"{where}: the URL answered HTTP {status} without a Location.", param)
        url = urllib.parse.urljoin(url, location)
    raise RequestError(f"{where}: the URL redirected more than {policy.max_redirects} times.", param)


def _destination(url: str, where: str, param: str, policy: FetchPolicy, deadline: float):
    """The URL's parts, host, port and the checked address to connect to."""
    try:
        parts = urllib.parse.urlsplit(url)
        hostname = parts.hostname
        host = normalize_host(hostname) if hostname else None
    except ValueError:  # e.g. `http://[::1/x`, `http://[zzz]/`, `http://\u2100.com/` (NFKC has a "/")
        raise RequestError(f"{where}: the URL is not valid.", param) from None
    if parts.scheme.lower() not in ("http", "https") or not host:
        raise RequestError(f"{where}: only http(s) URLs with a host are fetched.", param)
    if parts.username is not None or parts.password is not None:
        raise RequestError(f"{where}: a URL with credentials (user@host) is not fetched.", param)
    try:
        port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
    except ValueError:
        raise RequestError(f"{where}: the URL's port is not valid.", param) from None
    named = host in policy.allowed_domains
    if policy.allowed_domains and not named:
        raise RequestError(f"{where}: the host {host} is not in --allowed-media-domains.", param)
    addresses = [info[4][0] for info in _resolve(host, port, where, param, policy, deadline)]
    if not named:
        for a in addresses:
            if not is_public(ipaddress.ip_address(a.split("%")[0])):
                raise RequestError(
                    f"{where}: the host {host} has a non-public address; this server fetches from such "
                    "hosts only when --allowed-media-domains names them.",
                    param,
                )
    return parts, host, port, addresses[0]


# IPv6 ranges that carry an IPv4 address in their low 32 bits (NAT64, IPv4-compatible) or, for 6to4,
# in bits 16-48: Python's is_global judges the IPv6 address alone (::7f00:1 is "global").
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
_COMPAT = ipaddress.ip_network("::/96")


def is_public(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether `ip`, and any IPv4 address it embeds (mapped, compatible, NAT64, 6to4), is a public
    unicast address (multicast is not: Python counts some of it as global)."""
    if isinstance(ip, ipaddress.IPv6Address):
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and (ip in _NAT64 or ip in _COMPAT):
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None and not is_public(embedded):
            return False
    return ip.is_global and not ip.is_multicast


def _resolve(host: str, port: int, where: str, param: str, policy: FetchPolicy, deadline: float) -> list:
    """getaddrinfo within the fetch's deadline: it runs in a thread of its own, left to the system
    resolver's timeouts if the deadline passes first (the fetch thread is free at the deadline)."""
    out: dict = {}

    def run():
        try:
            out["infos"] = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            out["infos"] = None

    thread = threading.Thread(target=run, name="media-resolve", daemon=True)
    thread.start()
    thread.join(max(deadline - time.monotonic(), 0.0))
    if "infos" not in out:
        raise _timeout(where, param, policy)
    if not out["infos"]:
        raise RequestError(f"{where}: the host {host} could not be resolved.", param)
    return out["infos"]


class _Connection(http.client.HTTPConnection):
    """HTTP to a checked address, with a duplicate of the socket that another thread can shut down."""

    def __init__(self, host: str, port: int, address: str, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.address = address
        self.handle: socket.socket | None = None
        self.lock = threading.Lock()

    def _open(self) -> socket.socket:
        sock = socket.create_connection((self.address, self.port), self.timeout)
        with self.lock:
            self.handle = sock.dup()
        return sock

    def connect(self) -> None:
        self.sock = self._open()

    def cut(self) -> None:
        """Shut the connection down: the reading thread's next or current read ends."""
        with self.lock:
            if self.handle is not None:
                try:
                    self.handle.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def release(self) -> None:
        """Close the connection and the duplicate (`close` alone keeps the duplicate: http.client
        calls it when a response will end the connection, while that response is still read)."""
        self.close()
        with self.lock:
            if self.handle is not None:
                self.handle.close()
                self.handle = None


class _TLSConnection(_Connection):
    default_port = 443

    def connect(self) -> None:
        context = ssl.create_default_context()
        self.sock = context.wrap_socket(self._open(), server_hostname=self.host)


def _get(parts, host, port, address, where, param, policy, deadline, budget, scope):
    """(status, Location, body) of one GET; the body only for a 200."""
    remaining = deadline - time.monotonic()
    kind = _TLSConnection if parts.scheme.lower() == "https" else _Connection
    conn = kind(host, port, address, max(remaining, 0.001))
    if scope is not None and not scope.add(conn):
        raise _cancelled(where, param)
    timer = threading.Timer(remaining, conn.cut)
    timer.daemon = True
    timer.start()
    try:
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("GET", target, headers={"Accept": "image/*", "Accept-Encoding": "identity"})
        resp = conn.getresponse()
        if resp.status != 200:
            return resp.status, resp.getheader("Location"), b""
        limit = policy.max_bytes
        declared = resp.getheader("Content-Length", "")
        if limit is not None and declared.isdigit() and int(declared) > limit:
            raise _too_big(where, param, limit)
        body = bytearray()
        while True:
            piece = resp.read(READ_BYTES if limit is None else min(READ_BYTES, limit + 1 - len(body)))
            if not piece:
                break
            body += piece
            if limit is not None and len(body) > limit:
                raise _too_big(where, param, limit)
            if not budget.take(len(piece)):
                raise RequestError(
                    f"{where}: the request's files and URLs hold over {budget.limit} bytes.", param
                )
        if time.monotonic() >= deadline:  # the cut may end a read as a clean end of the body
            raise _timeout(where, param, policy)
        return 200, None, bytes(body)
    except RequestError:
        raise
    except (OSError, http.client.HTTPException, ValueError) as e:
        if scope is not None and scope.cancelled:
            raise _cancelled(where, param) from None
        if time.monotonic() >= deadline:
            raise _timeout(where, param, policy) from None
        raise RequestError(f"{where}: fetching the URL failed ({type(e).__name__}).", param) from None
    finally:
        timer.cancel()
        if scope is not None:
            scope.discard(conn)
        conn.release()


def _cancelled(where: str, param: str) -> RequestError:
    return RequestError(f"{where}: not fetched, the request was refused for another item.", param)


def _timeout(where: str, param: str, policy: FetchPolicy) -> RequestError:
    return RequestError(
        f"{where}: the URL did not answer in full within {policy.timeout_s:g} s (REQUEST_TIMEOUT).", param
    )


def _too_big(where: str, param: str, limit: int) -> RequestError:
    return RequestError(
        f"{where}: the URL sends more than {limit} bytes (--media-url-max-file-size-mb).", param
    )
