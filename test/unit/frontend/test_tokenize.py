"""/tokenize and /detokenize (issue 60, item 4) on the real app in process, with upstream's request and
reply shapes: the ids are the tokenizer's, lists give lists, bad input is a 400 naming the field, a
server without a tokenizer says it needs one, the body limit bounds the input, and a large detokenize
does not hold the event loop (its decode runs on a thread)."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest

from sglang.test.app_harness import LoopBystander, asgi_json, build_app, request_json, served_app
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=6, suite="per-commit-cpu")

TEXTS = ["Hello world, this is a test.", "héllo 日本語 🙂", ""]


@pytest.fixture(scope="module")
def served():
    with served_app(max_request_body_size=16 << 20) as pair:
        yield pair


def call(app, path: str, body) -> tuple[int, dict]:
    return request_json(app, "POST", path, body)


def test_tokenize_gives_the_tokenizers_ids_in_upstreams_shape(served):
    app, tm = served
    tok = tm.tokenizer
    for path in ("/tokenize", "/v1/tokenize"):
        status, out = call(app, path, {"model": "m", "prompt": TEXTS[0]})
        assert status == 200, out
        assert out == {
            "tokens": tok.encode(TEXTS[0]),
            "count": len(tok.encode(TEXTS[0])),
            "max_model_len": 4096,
        }
    for special in (True, False):
        status, out = call(app, "/tokenize", {"prompt": TEXTS, "add_special_tokens": special})
        want = [tok.encode(t, add_special_tokens=special) for t in TEXTS]
        assert status == 200 and out["tokens"] == want and out["count"] == [len(x) for x in want], out
    # A long text (tokenized in the worker process, off the loop) gives the same ids.
    long = "The quick brown fox jumps over the lazy dog. " * 800
    status, out = call(app, "/tokenize", {"prompt": long})
    assert status == 200 and out["tokens"] == tok.encode(long), out["count"]


def test_detokenize_inverts_tokenize(served):
    app, tm = served
    tok = tm.tokenizer
    ids = [tok.encode(t) for t in TEXTS]
    for path in ("/detokenize", "/v1/detokenize"):
        status, out = call(app, path, {"model": "m", "tokens": ids[1]})
        assert status == 200 and out == {"text": TEXTS[1]}, out
    status, out = call(app, "/detokenize", {"tokens": ids})
    assert status == 200 and out == {"text": TEXTS}, out
    special = [*ids[0], tok.eos_token_id]
    for skip in (True, False):
        status, out = call(app, "/detokenize", {"tokens": special, "skip_special_tokens": skip})
        assert out["text"] == tok.decode(special, skip_special_tokens=skip), out
    # Past the inline size the decode runs on a thread, with the same text.
    many = [5 + i % 500 for i in range(20_000)]
    status, out = call(app, "/detokenize", {"tokens": [many, ids[1]], "skip_special_tokens": False})
    assert out["text"] == [tok.decode(many, skip_special_tokens=False), TEXTS[1]]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/tokenize", {"prompt": 12}, "prompt"),
        ("/tokenize", {"model": "m"}, "prompt"),
        ("/tokenize", {"prompt": ["a", 3]}, "prompt"),
        ("/tokenize", b"[1]", None),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [1, -5]}, "tokens"),
        ("/detokenize", {"tokens": [[1], [2, 512]]}, "tokens[1]"),
        ("/v1/detokenize", {"tokens": [2**40]}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(served, path, body, param):
    app, _ = served
    status, out = call(app, path, body)
    assert status == 400 and out["param"] == param and out["error"]["param"] == param, out
    if param is not None:
        assert param.split("[")[0] in out["message"], out


def test_without_a_tokenizer_both_say_one_is_needed():
    app, _ = build_app(skip_tokenizer_init=True)
    for path, body, param in [
        ("/tokenize", {"prompt": "hi"}, "prompt"),
        ("/detokenize", {"tokens": [1]}, "tokens"),
    ]:
        status, out = call(app, path, body)
        assert status == 400 and out["param"] == param, out
        assert "needs a tokenizer" in out["message"] and "--skip-tokenizer-init" in out["message"], out


def test_the_body_limit_bounds_the_input():
    app, tm = build_app(max_request_body_size=1000)
    try:
        status, out = call(app, "/tokenize", {"prompt": "x" * 2000})
        assert status == 413 and "--max-request-body-size" in out["error"]["message"], out
    finally:
        tm.encoder.close()


def test_a_large_detokenize_leaves_the_loop_free(served):
    """A bystander on the event loop (a 1 ms ticker) beside the detokenize of 400,000 ids, about what the
    default body limit of a 32K-context model admits: with the decode on the loop its longest wait was
    0.33 s here (the decode alone 0.23 s), with the decode on a thread 0.09 s."""
    app, tm = served
    ids = [5 + i % 500 for i in range(400_000)]
    body = orjson.dumps({"tokens": ids})
    start = time.perf_counter()
    tm.tokenizer.decode(ids)
    inline = time.perf_counter() - start

    async def scenario() -> tuple[int, float]:
        async with LoopBystander() as bystander:
            status, _ = await asgi_json(app, "POST", "/detokenize", body)
        return status, bystander.worst

    status, worst = asyncio.run(scenario())
    assert status == 200
    # What remains on the loop is parsing and checking the body (pydantic, ~0.1 s for 400,000 ids on a
    # loaded 2-core host), as on every route; the decode itself no longer adds to it.
    assert worst < max(0.15, 0.6 * inline), (worst, inline)
