"""Request validation names the bad field; normalisation expands batches and n; stop strings trim text."""

from __future__ import annotations

import asyncio

import pytest

from sglang.srt.managers import text_encoder
from sglang.srt.managers.io_struct import BatchStrOut, GenerateReqInput
from sglang.srt.managers.request_sampling import DEFAULT_MAX_NEW_TOKENS
from sglang.srt.managers.request_validation import (
    RequestError,
    RequestLimits,
    max_samples_per_request,
    normalize_generate_request,
)
from sglang.srt.managers.tokenizer_output import ReqState
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

LIMITS = RequestLimits(context_len=64, max_req_input_len=63, vocab_size=512)
WIDE = RequestLimits(context_len=4096, max_req_input_len=4095, vocab_size=512)


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
            {"input_ids": [5], "sampling_params": {"stop_token_ids": [7, -1]}},
            "sampling_params.stop_token_ids",
            "at least 0",
        ),
        (
            {"input_ids": [5], "sampling_params": {"stop_token_ids": [7, "8"]}},
            "sampling_params.stop_token_ids",
            "integer",
        ),
        (
            {"input_ids": [5], "sampling_params": {"stop_token_ids": 7}},
            "sampling_params.stop_token_ids",
            "list",
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


def test_a_batch_of_upstream_size_is_admitted(tokenizer):
    """Upstream's radix-cache kit posts 401 prompts in one /generate (issue 60, item 7); the default
    bound was max(64, max running / 4), 64 on a server running 256 requests at once."""
    bound = max_samples_per_request(None, 256)
    assert bound == 4096
    assert max_samples_per_request(None, 8000) == 8000, "a full batch of running requests"
    assert max_samples_per_request(5, 8000) == 5
    batch = GenerateReqInput(
        input_ids=[[5 + i % 400, 6] for i in range(401)], sampling_params={"max_new_tokens": 2}
    )
    items, _ = normalize_generate_request(batch, tokenizer, WIDE, max_samples=bound)
    assert len(items) == 401 and items[400].req.input_ids == [5, 6]


@pytest.mark.parametrize(
    "kw, param, shape",
    [
        ({"input_ids": [[5]] * 4097}, "input_ids", "4097 sequences (4097 prompts in input_ids)"),
        ({"text": ["a"] * 4097}, "text", "4097 sequences (4097 prompts in text)"),
        ({"input_ids": [[5]] * 65, "sampling_params": {"n": 64}}, "sampling_params.n", "4160 sequences (65 prompts with n = 64)"),
        ({"input_ids": [[5]] * 4096, "sampling_params": [{"n": 2}] + [{}] * 4095}, "sampling_params.n", "4097 sequences"),
    ],
)  # fmt: skip
def test_a_request_past_the_bound_names_what_to_lower(tokenizer, kw, param, shape):
    with pytest.raises(RequestError) as e:
        normalize_generate_request(GenerateReqInput(**kw), tokenizer, WIDE, max_samples=4096)
    assert e.value.param == param
    assert (
        shape in e.value.message and "at most 4096 per request (--max-samples-per-request)" in e.value.message
    )


def test_logprob_entries_are_bounded_over_the_whole_batch(tokenizer):
    """--max-logprob-entries-per-request counts every sample of a batch: 300 prompts of 40 positions
    with top 20 from position 0 (860 entries each, 258,000 in all) fit the default 262,144; 400 do not,
    though each alone is far below it."""
    one = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 20}
    params = {"max_new_tokens": 1}
    for prompts, fits in ((1, True), (300, True), (400, False)):
        obj = GenerateReqInput(
            input_ids=[[5 + k % 7] * 40 for k in range(prompts)], sampling_params=params, **one
        )
        if fits:
            assert len(normalize_generate_request(obj, tokenizer, WIDE, max_samples=4096)[0]) == prompts
            continue
        with pytest.raises(RequestError) as e:
            normalize_generate_request(obj, tokenizer, WIDE, max_samples=4096)
        assert e.value.param == "logprob_start_len" and "344000 logprob entries" in e.value.message


def test_params_sent_once_for_a_batch_are_checked_once(tokenizer, monkeypatch):
    """A batch's shared sampling_params were parsed and checked for every prompt: a 107 KB json_schema
    for 4,096 prompts held the HTTP event loop 225 s. Each distinct object is checked once now; each
    prompt still gets its own max_new_tokens and each sample its own params."""
    import json
    import time

    from sglang.srt.sampling.sampling_params import SamplingParams

    calls = []
    verify = SamplingParams.verify
    monkeypatch.setattr(SamplingParams, "verify", lambda self, *a: calls.append(1) or verify(self, *a))
    props = {f"k{i}": {"type": "string", "pattern": "[a-z]{1,5}"} for i in range(2000)}
    schema = json.dumps({"type": "object", "properties": props})
    shared = {"json_schema": schema, "stop": ["x"]}
    obj = GenerateReqInput(input_ids=[[5] * (1 + k % 50) for k in range(4096)], sampling_params=shared)
    start = time.perf_counter()
    items, _ = normalize_generate_request(obj, tokenizer, WIDE, max_samples=4096)
    took = time.perf_counter() - start
    assert len(calls) == 2, "from_dict's own check and the one against the vocabulary, once"
    # Measured 0.14-0.35 s on a loaded 2-core host (~50 us a prompt, most of it building the requests);
    # 3 s leaves room for a slower one and is ~1/75 of the 225 s it took.
    assert took < 3.0, took
    assert [i.req.sampling_params.max_new_tokens for i in items[:3]] == [128, 128, 128]
    short = normalize_generate_request(
        GenerateReqInput(input_ids=[[5] * 60, [5] * 10], sampling_params=shared), tokenizer, LIMITS
    )[0]
    assert [i.req.sampling_params.max_new_tokens for i in short] == [4, 54], "each prompt's own room"
    a, b = (i.req.sampling_params for i in short)
    assert a is not b and a.stop is not b.stop and a.json_schema == schema
    calls.clear()
    normalize_generate_request(
        GenerateReqInput(input_ids=[[5], [6]], sampling_params=[{}, {}]), tokenizer, LIMITS
    )
    assert len(calls) == 4, "one object per prompt: each checked"


def test_stop_token_ids_outside_the_vocabulary_are_accepted(tokenizer):
    """Upstream accepts them (an id that can never be sampled never stops anything) and its
    JSON-constrained kit sends one; they were a 400 here (issue 60, item 6). They are dropped, so that
    min_new_tokens' ban of the stop ids never indexes the vocabulary's logits with one."""
    params = {"stop_token_ids": [7, 512, 10**12], "min_new_tokens": 1, "n": 2}
    items, _ = norm(tokenizer, input_ids=[[5], [6]], sampling_params=params)
    assert [i.req.sampling_params.stop_token_ids for i in items] == [[7]] * 4
    (item,), _ = norm(tokenizer, input_ids=[5], sampling_params={"stop_token_ids": [600]})
    assert item.req.sampling_params.stop_token_ids == []


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
