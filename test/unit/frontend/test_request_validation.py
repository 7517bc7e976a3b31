"""Request validation names the bad field; normalisation expands batches and n; stop strings trim text."""

from __future__ import annotations

import asyncio

import pytest

from sglang.srt.managers import text_encoder
from sglang.srt.managers.io_struct import BatchStrOut, GenerateReqInput
from sglang.srt.managers.request_validation import (
    DEFAULT_MAX_NEW_TOKENS,
    RequestError,
    RequestLimits,
    max_samples_per_request,
    normalize_generate_request,
)
from sglang.srt.managers.tokenizer_output import ReqState
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

LIMITS = RequestLimits(context_len=64, max_req_input_len=63, vocab_size=512)


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer("tiny-qwen3-next")


def norm(tokenizer, **kw):
    return normalize_generate_request(GenerateReqInput(**kw), tokenizer, LIMITS)


@pytest.mark.parametrize(
    "kw, param, words",
    [
        ({}, "text", "exactly one"),
        ({"text": "a", "input_ids": [1]}, "text", "exactly one"),
        ({"text": 5}, "text", "string"),
        ({"input_ids": []}, "input_ids", "empty"),
        ({"input_ids": [1, 512]}, "input_ids", "outside the vocabulary"),
        ({"input_ids": [1, -1]}, "input_ids", "outside the vocabulary"),
        ({"input_ids": [1, "x"]}, "input_ids", "integer"),
        ({"input_ids": [5] * 64}, "input_ids", "context length"),
        ({"text": "hello " * 80}, "text", "context length"),
        (
            {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 60}},
            "sampling_params.max_new_tokens",
            "context length",
        ),
        (
            {"input_ids": [5], "sampling_params": {"temperature": -1}},
            "sampling_params.temperature",
            "non-negative",
        ),
        ({"input_ids": [5], "sampling_params": {"top_p": 0}}, "sampling_params.top_p", "(0, 1]"),
        ({"input_ids": [5], "sampling_params": {"n": 65}}, "sampling_params.n", "at most"),
        ({"input_ids": [5], "sampling_params": {"bogus": 1}}, "sampling_params.bogus", "not a supported"),
        (
            {"input_ids": [5], "sampling_params": {"stop_token_ids": [600]}},
            "sampling_params.stop_token_ids",
            "vocabulary",
        ),
        ({"input_ids": [5], "sampling_params": [1]}, "sampling_params", "object"),
        ({"input_ids": [5, 6], "logprob_start_len": 2}, "logprob_start_len", "position"),
        ({"input_ids": [5], "top_logprobs_num": -1}, "top_logprobs_num", "0 or more"),
        ({"input_ids": [5], "return_logprob": "yes"}, "return_logprob", "boolean"),
        ({"input_ids": [[5], [6]], "sampling_params": [{}, {}, {}]}, "sampling_params", "3 entries"),
        ({"input_ids": [5], "rid": ["a", "b"]}, "rid", "single value"),
        ({"input_ids": [[5], [6]], "rid": ["a", "a"]}, "rid", "unique"),
        ({"input_ids": [5] * 70 + ["x"]}, "input_ids", "context length"),  # length before element checks
        (
            {"input_ids": [5], "sampling_params": {"stop_regex": "(a"}},
            "sampling_params.stop_regex",
            "regular",
        ),
        (
            {"input_ids": [5], "sampling_params": {"stop_regex": [""]}},
            "sampling_params.stop_regex",
            "non-empty",
        ),
        # Upstream's words, where the server runs without --enable-custom-logit-processor.
        ({"input_ids": [5], "custom_logit_processor": "{}"}, "custom_logit_processor", "not configured"),
    ],
)
def test_bad_requests_name_the_field(tokenizer, kw, param, words):
    with pytest.raises(RequestError) as e:
        norm(tokenizer, **kw)
    assert e.value.param == param
    assert words in e.value.message


def test_default_max_new_tokens_is_clamped_to_the_context(tokenizer):
    (item,), _ = norm(tokenizer, input_ids=[5] * 60)
    assert item.req.sampling_params.max_new_tokens == 4
    (item,), _ = norm(tokenizer, input_ids=[5] * 10, sampling_params={"max_new_tokens": None})
    assert item.req.sampling_params.max_new_tokens == min(DEFAULT_MAX_NEW_TOKENS, 54)


def test_batches_and_n_expand_prompt_major(tokenizer):
    items, is_list = norm(
        tokenizer,
        text=["a", "b"],
        sampling_params={"n": 2, "seed": 7},
        rid=["x", "y"],
        return_logprob=[True, False],
    )
    assert is_list
    assert [i.req.rid for i in items] == ["x-0", "x-1", "y-0", "y-1"]
    assert [i.index for i in items] == [0, 1, 2, 3]
    assert [i.req.sampling_params.n for i in items] == [1, 1, 1, 1]
    # Distinct seeds, so that n seeded samples are not n copies of one.
    assert [i.req.sampling_params.sampling_seed for i in items] == [7, 8, 7, 8]
    assert [i.req.return_logprob for i in items] == [True, True, False, False]
    assert items[0].req.input_ids == tokenizer.encode("a")


def test_single_prompt_is_not_a_list(tokenizer):
    items, is_list = norm(tokenizer, input_ids=[5, 6])
    assert not is_list and len(items) == 1 and items[0].req.input_ids == [5, 6]


@pytest.mark.parametrize(
    "kw, words",
    [
        ({"token_ids_logprob": 5}, "non-empty list"),
        ({"token_ids_logprob": []}, "non-empty list"),
        ({"token_ids_logprob": [1, "x"]}, "integer token ids"),
        ({"token_ids_logprob": [1, 512]}, "outside the vocabulary"),
        ({"token_ids_logprob": [[1], [2]]}, "integer token ids"),  # one prompt: one list of ids
        ({"input_ids": [[5], [6]], "token_ids_logprob": [[1], [2], [3]]}, "3 lists for a batch of 2"),
        ({"input_ids": [[5], [6]], "token_ids_logprob": [[1], []]}, "non-empty lists"),
        ({"token_ids_logprob": [1] * 21}, "at most 20 ids (--max-logprobs)"),
    ],
)
def test_token_ids_logprob_is_checked(tokenizer, kw, words):
    with pytest.raises(RequestError) as e:
        norm(tokenizer, **{"input_ids": [5], "return_logprob": True, **kw})
    assert e.value.param == "token_ids_logprob" and words in e.value.message, e.value.message


def test_token_ids_logprob_per_prompt_or_for_all(tokenizer):
    items, _ = norm(tokenizer, input_ids=[[5], [6]], token_ids_logprob=[3, 4])
    assert [i.req.token_ids_logprob for i in items] == [[3, 4], [3, 4]]
    items, _ = norm(tokenizer, input_ids=[[5], [6]], token_ids_logprob=[[3], None])
    assert [i.req.token_ids_logprob for i in items] == [[3], None]
    items, _ = norm(tokenizer, input_ids=[5], sampling_params={"n": 2}, token_ids_logprob=[9])
    assert [i.req.token_ids_logprob for i in items] == [[9], [9]], "every sample of n"


def make_state(tokenizer, stop: list[str], **sampling) -> ReqState:
    params = {"stop": stop, **sampling} if stop else None
    (item,), _ = norm(tokenizer, input_ids=[5], sampling_params=params)
    return ReqState(item, 0.0, asyncio.Event())


def feed(state: ReqState, text: str, finished: dict | None = None) -> None:
    state.apply(
        BatchStrOut(
            rids=[state.rid],
            finished_reasons=[finished],
            output_strs=[text],
            output_ids=[[7]],
            prompt_tokens=[1],
            completion_tokens=[len(state.output_ids) + 1],
            cached_tokens=[0],
        ),
        0,
    )


def test_stop_string_prefix_is_held_back_and_trimmed(tokenizer):
    state = make_state(tokenizer, ["STOP"])
    seen = []
    for piece in ["Hello S", "T", "OP!"]:
        feed(state, piece)
        seen.append(state.visible_text())
    feed(state, "", {"type": "stop", "matched": "STOP"})
    seen.append(state.visible_text())
    assert seen == ["Hello ", "Hello ", "Hello ", "Hello "]


def test_no_stop_trim_keeps_the_stop_string_and_holds_nothing_back(tokenizer):
    state = make_state(tokenizer, ["STOP"], no_stop_trim=True)
    feed(state, "Hello S")
    assert state.visible_text() == "Hello S"
    feed(state, "TOP!", {"type": "stop", "matched": "STOP"})
    assert state.visible_text() == "Hello STOP!", "upstream's no_stop_trim: the output as generated"


def test_held_back_text_is_released_when_it_is_not_a_stop(tokenizer):
    state = make_state(tokenizer, ["STOP"])
    feed(state, "a ST")
    assert state.visible_text() == "a "
    feed(state, "AR")
    assert state.visible_text() == "a STAR"
    feed(state, " S", {"type": "length", "length": 3})
    assert state.visible_text() == "a STAR S", "a finished request shows all of its text"


def test_stream_markers_report_only_changes(tokenizer):
    state = make_state(tokenizer, [])
    assert not state.has_unsent_update()
    feed(state, "x")
    assert state.has_unsent_update()
    state.mark_sent()
    assert not state.has_unsent_update()
    feed(state, "", {"type": "length", "length": 2})
    assert state.has_unsent_update(), "the finish itself is an update"


def test_one_request_may_not_fan_out_past_the_cap(tokenizer):
    big = GenerateReqInput(input_ids=[[5]] * 64, sampling_params={"n": 64})
    with pytest.raises(RequestError) as e:
        normalize_generate_request(big, tokenizer, LIMITS, max_samples=1024)
    assert e.value.param == "sampling_params.n"
    assert "4096 sequences (64 prompts with n = 64)" in e.value.message
    assert "--max-samples-per-request" in e.value.message
    ok = GenerateReqInput(input_ids=[[5]] * 16, sampling_params={"n": 64})
    items, _ = normalize_generate_request(ok, tokenizer, LIMITS, max_samples=1024)
    assert len(items) == 1024
    assert max_samples_per_request(None, 4096) == 1024
    assert max_samples_per_request(None, 8) == 64, "one prompt may always ask for the largest n"
    assert max_samples_per_request(5, 4096) == 5


def test_stop_regex_reaches_every_sample(tokenizer):
    items, _ = norm(tokenizer, input_ids=[5], sampling_params={"n": 2, "stop_regex": r"\d+"})
    assert [i.req.sampling_params.stop_regex for i in items] == [[r"\d+"], [r"\d+"]]


def test_a_long_text_far_past_the_limit_is_counted_from_a_prefix(tokenizer, monkeypatch):
    monkeypatch.setattr(text_encoder, "_worker_tokenizer", tokenizer)
    text = "hello world, this is a test. " * 20_000  # ~580k characters
    [(ids, n, at_least)] = text_encoder._encode_in_worker([text], 64, True)
    assert ids is None and at_least
    assert 64 < n < len(tokenizer.encode(text)), "a lower bound, from a prefix only"
    short = "hello world. " * 3
    [(ids, n, at_least)] = text_encoder._encode_in_worker([short], 64, True)
    assert ids == tokenizer.encode(short) and n == len(ids) and not at_least


def test_a_batch_of_texts_long_together_goes_to_the_worker_in_one_call(tokenizer, monkeypatch):
    """Each text is short, but 64 of them are ~1 MB: tokenizing them on the event loop would hold up
    every other request for about a second."""
    import asyncio

    calls = []

    class Pool:  # stands in for the worker process: one call, the whole batch
        def submit(self, fn, *args):
            calls.append(len(args[0]))
            from concurrent.futures import Future

            fut = Future()
            fut.set_result(fn(*args))
            return fut

    monkeypatch.setattr(text_encoder, "_worker_tokenizer", tokenizer)
    enc = text_encoder.TextEncoder(tokenizer, "tiny-qwen3-next")
    enc._pool = Pool()
    texts = ["word " * 3000] * 64  # 15,000 characters each: every one alone would be tokenized inline
    out = asyncio.run(enc.encode_many(texts, 4096))
    assert calls == [64] and len(out) == 64
    short = asyncio.run(enc.encode_many(["hello world"] * 3, 4096))
    assert calls == [64] and short[0].ids == tokenizer.encode("hello world")


def test_a_dead_tokenizer_worker_is_a_backend_error_not_a_500(tokenizer):
    import asyncio
    from concurrent.futures import Future
    from concurrent.futures.process import BrokenProcessPool

    from sglang.srt.managers.backend_health import BackendDeadError

    class DeadPool:
        def submit(self, fn, *args):
            fut = Future()
            fut.set_exception(BrokenProcessPool("gone"))
            return fut

    enc = text_encoder.TextEncoder(tokenizer, "tiny-qwen3-next")
    enc._pool = DeadPool()
    with pytest.raises(BackendDeadError, match="tokenizer worker"):
        asyncio.run(enc.encode_many(["x" * 20_000], 4096))
    assert enc._pool is None, "the next long text starts a fresh worker"


@pytest.mark.parametrize(
    "kw, param, words",
    [
        ({"custom_logit_processor": 5}, "custom_logit_processor", "to_str()"),
        ({"custom_logit_processor": ["{}", "{}"]}, "custom_logit_processor", "single value"),
        ({"sampling_params": {"custom_params": [1]}}, "sampling_params.custom_params", "object"),
    ],
)
def test_custom_logit_processor_fields_are_checked(tokenizer, kw, param, words):
    limits = RequestLimits(64, 63, 512, custom_logit_processor_enabled=True)
    with pytest.raises(RequestError) as e:
        normalize_generate_request(GenerateReqInput(input_ids=[5], **kw), tokenizer, limits)
    assert e.value.param == param and words in e.value.message
    items, _ = normalize_generate_request(
        GenerateReqInput(input_ids=[[5], [6]], custom_logit_processor=["{}", None]), tokenizer, limits
    )
    assert [i.req.custom_logit_processor for i in items] == ["{}", None]
