"""Error bodies in upstream SGLang's shape (its `ErrorResponse`: `object`, `message`, `type`, `param` and
`code`, the HTTP status as an int, at the top level) with OpenAI's nested `error` object beside them,
on the real app in process: a client written for SGLang and the `openai` client (which reads
`body["error"]` when there is one) both read the field and the status."""

from __future__ import annotations

import asyncio

import httpx2
import openai
import orjson
import pytest

from sglang.srt.entrypoints.http_errors import error_body
from sglang.srt.entrypoints.openai.serving_base import sse_stream
from sglang.srt.managers.tokenizer_manager import ServerAbortError
from sglang.test.app_harness import request_json, served_app
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


@pytest.fixture(scope="module")
def served():
    # control routes answer 503 (no scheduler here)
    with served_app(control_unanswered=True) as (app, tm):
        yield app, tm


def assert_upstream_shape(status: int, body: dict, param: str | None, kind: str) -> None:
    """Upstream's fields at the top level (code: the status, an int), OpenAI's nested beside them."""
    assert body["object"] == "error", body
    assert body["code"] == status and isinstance(body["code"], int), body
    assert body["param"] == param and body["type"] == kind, body
    assert body["message"].endswith("."), body
    nested = body["error"]
    assert (nested["message"], nested["param"], nested["type"]) == (body["message"], param, kind), body


def test_request_errors_on_generate_and_the_openai_routes(served):
    app, _ = served
    status, body = request_json(app, "POST", "/generate", b"{not json}")
    assert status == 400
    assert_upstream_shape(status, body, None, "invalid_request_error")
    assert body["error"]["code"] == "invalid_json"  # OpenAI's code stays a string in the nested object
    status, body = request_json(app, "POST", "/generate", orjson.dumps({"input_ids": [1, -5]}))
    assert status == 400
    assert_upstream_shape(status, body, "input_ids", "invalid_request_error")
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}
    status, body = request_json(app, "POST", "/v1/chat/completions", orjson.dumps(chat))
    assert status == 400
    assert_upstream_shape(status, body, "max_tokens", "invalid_request_error")
    status, body = request_json(app, "POST", "/v1/completions", orjson.dumps({"model": "m"}))
    assert status == 400
    assert_upstream_shape(status, body, "prompt", "invalid_request_error")


def test_server_errors_carry_their_status(served, monkeypatch):
    app, tm = served
    status, body = request_json(app, "POST", "/flush_cache")  # the scheduler did not answer
    assert status == 503
    assert_upstream_shape(status, body, None, "server_error")
    assert body["error"]["code"] == "timeout"
    status, body = request_json(app, "GET", "/no_such_route")
    assert status == 404 and body["object"] == "error" and body["code"] == 404, body

    def failing(error: Exception):
        async def generate_request(obj, request=None):
            raise error
            yield  # (an async generator, as the real one)

        return generate_request

    # Upstream's waiting-timeout kit counts an error where code is 503 (it read none here before).
    monkeypatch.setattr(
        tm, "generate_request", failing(ServerAbortError(503, "Request waiting timeout reached."))
    )
    status, body = request_json(app, "POST", "/generate", orjson.dumps({"input_ids": [1, 2]}))
    assert status == 503
    assert_upstream_shape(status, body, None, "server_error")
    monkeypatch.setattr(tm, "generate_request", failing(RuntimeError("boom")))
    status, body = request_json(app, "POST", "/generate", orjson.dumps({"input_ids": [1, 2]}))
    assert status == 500 and body["code"] == 500 and body["error"]["code"] == "internal_error", body


def test_a_stream_error_event_has_the_same_shape():
    async def events():
        yield b"data: {}\n\n"
        raise ServerAbortError(503, "Request running timeout reached.")

    async def collect():
        return [e async for e in sse_stream(events())]

    error = orjson.loads(asyncio.run(collect())[1][len(b"data: ") :])
    assert error == error_body("Request running timeout reached.", kind="server_error", code=503, status=503)
    assert error["code"] == 503 and error["object"] == "error"


def test_the_openai_client_reads_the_nested_error(served):
    """openai's client takes body["error"] when present, else the body: its param and code are OpenAI's."""
    app, _ = served
    transport = httpx2.ASGITransport(app=app)

    async def ask() -> openai.BadRequestError:
        client = openai.AsyncOpenAI(
            base_url="http://test/v1", api_key="-", http_client=httpx2.AsyncClient(transport=transport)
        )
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=0
            )
        except openai.BadRequestError as e:
            return e
        raise AssertionError("no error")

    e = asyncio.run(ask())
    assert e.status_code == 400 and e.param == "max_tokens" and e.code == "invalid_value", e.body
    assert e.type == "invalid_request_error"
