"""Incremental detokenization: never a partial UTF-8 character mid-stream, exact text once finished."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang.srt.managers.detokenizer_manager import (
    REPLACEMENT_CHAR,
    DetokenizerManager,
    IncrementalDetokenizer,
)
from sglang.srt.managers.io_struct import BatchTokenIDOut
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=5, suite="per-commit-cpu")

MULTIBYTE = "héllo wörld, 世界 🙂 ok ü"


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer("tiny-qwen3-next")


def stream(tokenizer, ids: list[int], chunks: list[int], skip: bool = True) -> list[str]:
    """Feed `ids` in pieces of the given sizes; the last piece finishes the request."""
    det = IncrementalDetokenizer(tokenizer, skip)
    out, pos = [], 0
    for size in chunks:
        piece = ids[pos : pos + size]
        pos += size
        out.append(det.push(piece, finished=pos >= len(ids)))
    return out


def test_multibyte_characters_split_over_tokens_are_held_back(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    # The byte-level tokenizer really splits some characters (else this test would prove nothing).
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)
    deltas = stream(tokenizer, ids, [1] * len(ids))
    assert "".join(deltas) == MULTIBYTE
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


def test_truncated_character_is_flushed_on_finish(tokenizer):
    ids = tokenizer.encode("ab🙂")
    cut = next(i for i in range(len(ids), 0, -1) if tokenizer.decode(ids[:i]).endswith(REPLACEMENT_CHAR))
    deltas = stream(tokenizer, ids[:cut], [1] * cut)
    assert all(REPLACEMENT_CHAR not in d for d in deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids[:cut])
    assert deltas[-1].endswith(REPLACEMENT_CHAR)


def test_special_tokens_follow_skip_flag(tokenizer):
    ids = tokenizer.encode("hi") + [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert "".join(stream(tokenizer, ids, [1] * len(ids), skip=True)) == "hi"
    assert "".join(stream(tokenizer, ids, [1] * len(ids), skip=False)) == "hi<|im_end|>"


def out_msg(rids, ids, reasons, skip=None, no_stop_trim=None):
    n = len(rids)
    return BatchTokenIDOut(
        rids=rids,
        finished_reasons=reasons,
        output_ids=ids,
        prompt_tokens=[1] * n,
        completion_tokens=[len(x) for x in ids],
        cached_tokens=[0] * n,
        skip_special_tokens=skip or [True] * n,
        no_stop_trim=no_stop_trim or [False] * n,
    )


def test_manager_interleaves_requests_and_frees_state(tokenizer):
    mgr = DetokenizerManager(tokenizer)
    a, b = tokenizer.encode("héllo"), tokenizer.encode("🙂 x")
    texts = {"a": "", "b": ""}
    for i in range(max(len(a), len(b))):
        rids = [r for r, ids in (("a", a), ("b", b)) if i < len(ids)]
        ids = [[{"a": a, "b": b}[r][i]] for r in rids]
        done = [{"type": "length"} if i == len({"a": a, "b": b}[r]) - 1 else None for r in rids]
        res = mgr.handle_batch_token_id_out(out_msg(rids, ids, done))
        for rid, text in zip(res.rids, res.output_strs, strict=True):
            assert REPLACEMENT_CHAR not in text
            texts[rid] += text
    assert texts == {"a": "héllo", "b": "🙂 x"}
    assert mgr.states == {}


def test_matched_stop_token_is_not_in_the_text(tokenizer):
    mgr = DetokenizerManager(tokenizer)
    ids = tokenizer.encode("abc")
    stop = ids[-1]
    res = mgr.handle_batch_token_id_out(out_msg(["r"], [ids], [{"type": "stop", "matched": stop}]))
    assert res.output_strs == [tokenizer.decode(ids[:-1])]
    assert res.output_ids == [ids], "output ids keep the stop token, as SGLang's do"
    kept = mgr.handle_batch_token_id_out(
        out_msg(["r"], [ids], [{"type": "stop", "matched": stop}], no_stop_trim=[True])
    )
    assert kept.output_strs == [tokenizer.decode(ids)], "no_stop_trim keeps the stop token's text"


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet=st.sampled_from(list("aZ 0é世界🙂ü€\n")), min_size=1, max_size=30),
    seed=st.integers(0, 10_000),
)
def test_any_chunking_reassembles_the_text(tokenizer, text, seed):
    import random

    ids = tokenizer.encode(text)
    rng = random.Random(seed)
    chunks, left = [], len(ids)
    while left:
        chunks.append(min(left, rng.randint(1, 3)))
        left -= chunks[-1]
    deltas = stream(tokenizer, ids, chunks)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)
