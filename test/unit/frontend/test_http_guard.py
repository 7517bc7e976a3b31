"""The HTTP request guard and the request-head deadline, on a real uvicorn server in this process (a
tiny echo app, no model): oversized bodies get 413 before they are read whole, stalled uploads 408,
clients that leave mid-body count as 499 without a traceback, and connections that never send a
complete request head are closed."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import orjson
import pytest
import uvicorn

from sglang.launch_server import bind_socket
from sglang.srt.entrypoints.http_guard import RequestGuard, timed_h11_protocol
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")

LIMIT = 1000
TIMEOUT = 0.5


async def echo_app(scope, receive, send):
    """Answers with the length of the body it received."""
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    payload = orjson.dumps({"received": len(body)})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


@pytest.fixture(scope="module")
def server():
    statuses: list[int] = []
    app = RequestGuard(echo_app, max_body_bytes=LIMIT, read_timeout=TIMEOUT, on_response=statuses.append)
    config = uvicorn.Config(app, lifespan="off", log_level="warning", http=timed_h11_protocol(TIMEOUT))
    srv = uvicorn.Server(config)
    sock = bind_socket("127.0.0.1", 0)
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.02)
    yield sock.getsockname()[1], statuses
    srv.should_exit = True
    thread.join(5)
    sock.close()


def connect(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    return s


def read_all(s: socket.socket, timeout: float = 5) -> bytes:
    s.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = s.recv(65536)
        except (ConnectionResetError, TimeoutError):
            return data
        if not chunk:
            return data
        data += chunk


def head(length: int | None = None, chunked: bool = False) -> bytes:
    lines = ["POST /generate HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    if chunked:
        lines.append("Transfer-Encoding: chunked")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def status_and_body(raw: bytes) -> tuple[int, bytes]:
    first, _, rest = raw.partition(b"\r\n")
    return int(first.split()[1]), rest.partition(b"\r\n\r\n")[2]


def test_a_body_within_the_limit_reaches_the_app_whole(server):
    port, _ = server
    with connect(port) as s:
        s.sendall(head(600) + b"x" * 300)
        time.sleep(0.05)
        s.sendall(b"y" * 300)
        status, body = status_and_body(read_all(s, 2))
    assert status == 200 and orjson.loads(body) == {"received": 600}


def test_a_declared_oversized_body_is_refused_before_it_is_sent(server):
    port, statuses = server
    with connect(port) as s:
        s.sendall(head(10 * LIMIT))  # no body byte sent: the answer cannot have waited for it
        status, body = status_and_body(read_all(s))
    assert status == 413
    message = orjson.loads(body)["error"]["message"]
    assert f"limit of {LIMIT} bytes" in message and "--max-request-body-size" in message
    assert statuses[-1] == 413


def test_a_chunked_body_is_refused_once_it_passes_the_limit(server):
    port, _ = server
    with connect(port) as s:
        s.sendall(head(chunked=True))
        for _ in range(3):
            s.sendall(b"258\r\n" + b"z" * 600 + b"\r\n")
        status, _ = status_and_body(read_all(s))
    assert status == 413


def test_a_stalled_upload_gets_408_and_its_connection_closes(server):
    port, statuses = server
    with connect(port) as s:
        s.sendall(head(500) + b"x" * 100)
        t0 = time.monotonic()
        raw = read_all(s, timeout=5 * TIMEOUT)
        elapsed = time.monotonic() - t0
    assert status_and_body(raw)[0] == 408
    assert TIMEOUT * 0.8 < elapsed < TIMEOUT * 4
    assert statuses[-1] == 408


def test_clients_that_leave_mid_body_count_as_499_without_errors(server, caplog):
    port, statuses = server
    before = statuses.count(499)
    with caplog.at_level(logging.WARNING):
        for _ in range(20):
            s = connect(port)
            s.sendall(head(500) + b"x" * 100)
            s.close()
        deadline = time.monotonic() + 5
        while statuses.count(499) - before < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
    assert statuses.count(499) - before == 20
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


@pytest.mark.parametrize("sent", [b"", b"POST /generate HTTP/1.1\r\nHost: 127"])
def test_a_connection_without_a_complete_request_head_is_closed(server, sent):
    port, _ = server
    with connect(port) as s:
        s.sendall(sent)
        t0 = time.monotonic()
        assert read_all(s, timeout=5 * TIMEOUT) == b""  # closed by the server, nothing answered
        assert time.monotonic() - t0 < TIMEOUT * 4


def test_an_idle_keep_alive_connection_is_closed_too(server):
    port, _ = server
    with connect(port) as s:
        s.sendall(head(2) + b"{}")
        t0 = time.monotonic()
        raw = read_all(s, timeout=5 * TIMEOUT)  # the answer, then the close
        assert time.monotonic() - t0 < TIMEOUT * 4, "closed by the server, not by the read timeout"
    assert status_and_body(raw) == (200, b'{"received":2}')


def test_replayed_body_then_disconnect_is_seen_by_the_app():
    """After the buffered body, the app's next receive() is the client's real next message."""
    messages = [{"type": "http.request", "body": b"ab", "more_body": False}, {"type": "http.disconnect"}]
    seen = []

    async def app(scope, receive, send):
        seen.append(await receive())
        seen.append(await receive())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    async def receive():
        return messages.pop(0)

    async def send(message):
        pass

    guard = RequestGuard(app, max_body_bytes=LIMIT, read_timeout=TIMEOUT)
    asyncio.run(guard({"type": "http", "headers": []}, receive, send))
    assert seen == [{"type": "http.request", "body": b"ab", "more_body": False}, {"type": "http.disconnect"}]
