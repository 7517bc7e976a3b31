"""The real HTTP app in process for unit tests: create_app over a TokenizerManager with no scheduler
behind it, one ASGI request at a time without a socket, and a bystander on the event loop that measures
how long a request holds the loop. Routes that need the scheduler can only refuse here; that is what
the tests built on it ask of them."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Iterator
from typing import Any

import orjson

# A small server's numbers, as the scheduler would report them at startup.
MODEL_INFO = {"context_len": 4096, "max_req_input_len": 4095, "vocab_size": 512, "max_running_requests": 8}

Headers = Iterable[tuple[bytes, bytes]]


async def unanswered(req: Any, reply_type: Any, timeout: Any) -> Any:
    raise TimeoutError("The scheduler did not answer.")


def build_app(
    model_info: dict | None = None, *, control_unanswered: bool = False, **server_args: Any
) -> tuple[Any, Any]:
    """(app, tokenizer manager) for ServerArgs(model_path="tiny-qwen3-next", **server_args). With
    control_unanswered, control routes fail at once as if the scheduler timed out (a 503) instead of
    waiting for a scheduler that is not there. The caller closes tm.encoder (or uses served_app)."""
    from sglang.srt.entrypoints.http_server import create_app
    from sglang.srt.managers.io_struct import PortArgs
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.server_args import ServerArgs

    info = MODEL_INFO if model_info is None else model_info
    args = ServerArgs(**{"model_path": "tiny-qwen3-next", **server_args})
    tm = TokenizerManager(args, PortArgs.init_new(), info)
    if control_unanswered:
        tm._control = unanswered
    return create_app(args, tm, info), tm


@contextlib.contextmanager
def served_app(
    model_info: dict | None = None, *, control_unanswered: bool = False, **server_args: Any
) -> Iterator[tuple[Any, Any]]:
    """build_app's pair, its tokenizer worker closed on exit."""
    app, tm = build_app(model_info, control_unanswered=control_unanswered, **server_args)
    try:
        yield app, tm
    finally:
        tm.encoder.close()


async def asgi_request(
    app: Any,
    method: str,
    path: str,
    body: bytes = b"{}",
    headers: Headers = (),
    reads: list | None = None,
) -> tuple[int, bytes]:
    """The status and body of the app's reply to `method path` (a query after `?`) with a JSON content
    type, `headers` after it and `body` in one message; `reads` (when given) collects each message the app receives."""
    path, _, query = path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
             "headers": [(b"content-type", b"application/json"), *headers], "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80)}  # fmt: skip
    sent = []

    async def receive():
        message = {"type": "http.request", "body": body, "more_body": False}
        if reads is not None:
            reads.append(message)
        return message

    async def send(message):
        sent.append(message)

    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def request(*args: Any, **kwargs: Any) -> tuple[int, bytes]:
    """asgi_request (its arguments, its reply) on a loop of its own."""
    return asyncio.run(asgi_request(*args, **kwargs))


async def asgi_json(app: Any, method: str, path: str, body: Any = b"{}") -> tuple[int, Any]:
    """asgi_request with a JSON reply decoded; `body` is sent as is when bytes, else as its JSON."""
    raw = body if isinstance(body, bytes) else orjson.dumps(body)
    status, reply = await asgi_request(app, method, path, raw)
    return status, orjson.loads(reply)


def request_json(app: Any, method: str, path: str, body: Any = b"{}") -> tuple[int, Any]:
    """asgi_json on a loop of its own."""
    return asyncio.run(asgi_json(app, method, path, body))


class LoopBystander:
    """A bystander on the running event loop: a 1 ms ticker started on entry (given 10 ms to settle)
    and stopped on exit; `worst` is its longest wait between two ticks, how long the loop was held."""

    def __init__(self) -> None:
        self.gaps = [0.0]
        self._done = asyncio.Event()
        self._task: asyncio.Future | None = None

    async def _tick(self) -> None:
        last = time.perf_counter()
        while not self._done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now

    async def __aenter__(self) -> LoopBystander:
        self._task = asyncio.ensure_future(self._tick())
        await asyncio.sleep(0.01)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._done.set()
        await self._task

    @property
    def worst(self) -> float:
        return max(self.gaps)
