"""Stop strings in the HTTP process: `stop` is bounded (a 400 naming it, native and OpenAI), and a stream's
text is scanned for them incrementally (`StopScan`): the same cut and held-back text as a scan of the
whole text at every chunk, for a cost that grows with the chunk, not with the text or its square."""

from __future__ import annotations

import asyncio
import random
import threading

import pytest

from sglang.srt.constrained.stop_strings import MAX_STOP_CHARS, MAX_STOP_TOTAL_CHARS, MAX_STOPS
from sglang.srt.entrypoints.openai.protocol import CompletionRequest
from sglang.srt.entrypoints.openai.serving_base import parse_model
from sglang.srt.entrypoints.openai.serving_completions import OpenAIServingCompletion
from sglang.srt.managers.io_struct import BatchStrOut, GenerateReqInput
from sglang.srt.managers.request_validation import RequestError, RequestLimits, normalize_generate_request
from sglang.srt.managers.tokenizer_output import OFF_LOOP_SCAN, ReqState
from sglang.srt.utils.hf_transformers_utils import get_tokenizer
from sglang.srt.utils.text_markers import StopScan, partial_marker_len
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=2, suite="per-commit-cpu")

LIMITS = RequestLimits(context_len=4096, max_req_input_len=4095, vocab_size=512)


@pytest.fixture(scope="module")
def tokenizer():
    return get_tokenizer("tiny-qwen3-next")


def _refusal(tokenizer, obj: GenerateReqInput) -> RequestError:
    with pytest.raises(RequestError) as e:
        normalize_generate_request(obj, tokenizer, LIMITS)
    return e.value


FULL = MAX_STOP_TOTAL_CHARS // MAX_STOP_CHARS  # strings of the longest length that fit the total
OVER = {
    "count": [f"s{i}" for i in range(MAX_STOPS + 1)],
    "length": ["x" * (MAX_STOP_CHARS + 1)],
    "total": [f"{i:02d}" + "y" * (MAX_STOP_CHARS - 2) for i in range(FULL + 1)],
}
AT = {
    "count": [f"s{i}" for i in range(MAX_STOPS)],
    "length": ["x" * MAX_STOP_CHARS],
    "total": [f"{i:02d}" + "y" * (MAX_STOP_CHARS - 2) for i in range(FULL)],
}


@pytest.mark.parametrize("bound", sorted(OVER))
def test_stop_over_a_bound_is_a_400_naming_it_native_and_openai(tokenizer, bound):
    params = {"stop": OVER[bound], "max_new_tokens": 4}
    err = _refusal(tokenizer, GenerateReqInput(input_ids=[5], sampling_params=params))
    assert err.param == "sampling_params.stop" and "at most" in err.message, err.message
    # /v1/completions: the same check, named as OpenAI names the field.
    body = CompletionRequest(prompt=[5], stop=OVER[bound], max_tokens=4).model_dump_json().encode()
    serving = OpenAIServingCompletion(None, "m")
    obj = asyncio.run(serving.to_generate_input(parse_model(CompletionRequest, body)))
    err = serving.rename(_refusal(tokenizer, obj))
    assert err.param == "stop" and err.message.startswith("stop "), err.message
    # At the bound it is served.
    (item,), _ = normalize_generate_request(
        GenerateReqInput(input_ids=[5], sampling_params={**params, "stop": AT[bound]}), tokenizer, LIMITS
    )
    assert item.req.sampling_params.stop == AT[bound]


# ---- the scan --------------------------------------------------------------------------------------


def full_scan_visible(text: str, stops: list[str], finished: dict | None) -> str:
    """The visible text as it was computed before the incremental scan (every stop over the whole text,
    every prefix of every stop tried at its end): the oracle."""
    matched = (finished or {}).get("matched")
    cuts = [c for c in (text.find(s) for s in stops) if c >= 0]
    if isinstance(matched, str) and matched in text:
        cuts.append(text.find(matched))
    if cuts:
        return text[: min(cuts)]
    if finished is not None:
        return text
    best = 0
    for marker in stops:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return text[: len(text) - best]


def make_state(tokenizer, stops: list[str]) -> ReqState:
    params = {"stop": stops, "max_new_tokens": 4000}
    obj = GenerateReqInput(input_ids=[5], sampling_params=params)
    (item,), _ = normalize_generate_request(obj, tokenizer, LIMITS)
    return ReqState(item, 0.0, asyncio.Event())


def feed(state: ReqState, text: str, finished: dict | None = None) -> None:
    out = BatchStrOut(
        rids=[state.rid],
        finished_reasons=[finished],
        output_strs=[text],
        output_ids=[[7]],
        prompt_tokens=[1],
        completion_tokens=[len(state.output_ids) + 1],
        cached_tokens=[0],
    )
    state.apply(out, 0)


def _word(rnd: random.Random, alphabet: str, low: int, high: int) -> str:
    return "".join(rnd.choice(alphabet) for _ in range(rnd.randint(low, high)))


def test_the_incremental_scan_cuts_and_holds_back_as_the_full_scan_at_every_chunk(tokenizer):
    """Random texts over a 3-letter alphabet (so that stops, and their beginnings, occur and span
    chunks), random stops, random chunkings (empty chunks included), and a finish with a matched stop,
    another stop, a token id or none: after every chunk the visible text is the full scan's."""
    rnd = random.Random(1234)
    spans = 0
    for _ in range(400):
        stops = list({_word(rnd, "abc", 1, 7) for _ in range(rnd.randint(1, 6))})
        text = _word(rnd, "abc", 0, 60)
        state = make_state(tokenizer, stops)
        at = 0
        while at < len(text):
            piece = text[at : at + rnd.choice((0, 1, 1, 2, 3, 5, 8))]
            at += len(piece)
            last = at >= len(text)
            finished = None
            if last and rnd.random() < 0.7:
                finished = rnd.choice(
                    [{"type": "stop", "matched": rnd.choice(stops)}, {"type": "stop", "matched": 7},
                     {"type": "stop", "matched": "cab"}, {"type": "length", "length": 9}]
                )  # fmt: skip
            before = len(state.text)
            feed(state, piece, finished)
            want = full_scan_visible(state.text, stops, finished)
            assert state.visible_text() == want, (stops, state.text, finished)
            cut = min((c for c in (state.text.find(s) for s in stops) if c >= 0), default=-1)
            spans += 0 <= cut < before < cut + max(map(len, stops)) and len(want) == cut
    assert spans > 50, "stops that span two chunks were exercised"


def test_partial_marker_len_is_the_longest_held_end():
    rnd = random.Random(7)
    for _ in range(2000):
        markers = [_word(rnd, "ab", 1, 8) for _ in range(rnd.randint(0, 5))]
        text = _word(rnd, "ab", 0, 20)
        best = 0
        for m in markers:
            best = max([best] + [n for n in range(1, min(len(m) - 1, len(text)) + 1) if text.endswith(m[:n])])
        assert partial_marker_len(text, markers) == best, (text, markers)


class CountingStr(str):
    """A text that counts the characters its searches read: find (from its start), startswith / endswith
    (the argument), `in` (the whole) and slices that begin inside it (what a scan of its end reads). A
    slice from its beginning is the reply's copy of the visible text, which a cumulative stream sends
    whole at every chunk (upstream's format): not the stop strings' cost."""

    read = 0

    def __add__(self, other: str) -> CountingStr:
        return CountingStr(str.__add__(self, other))

    def find(self, sub, start=None, end=None):  # type: ignore[override]
        CountingStr.read += len(self) - max(start or 0, 0)
        return str.find(self, sub, *((start,) if start is not None else ()), *((end,) if end else ()))

    def startswith(self, prefix, *args):  # type: ignore[override]
        CountingStr.read += len(prefix)
        return str.startswith(self, prefix, *args)

    def endswith(self, suffix, *args):  # type: ignore[override]
        CountingStr.read += len(suffix)
        return str.endswith(self, suffix, *args)

    def __contains__(self, sub):  # type: ignore[override]
        CountingStr.read += len(self)
        return str.__contains__(self, sub)

    def __getitem__(self, key):  # type: ignore[override]
        value = str.__getitem__(self, key)
        if isinstance(key, slice) and key.start:
            CountingStr.read += len(value)
        return value


def _stream_cost(tokenizer, stops: list[str], chunks: int, size: int) -> int:
    rnd = random.Random(3)
    state = make_state(tokenizer, stops)
    state.text = CountingStr("")
    CountingStr.read = 0
    for _ in range(chunks):
        feed(state, _word(rnd, "abcdefgh ", size, size))
        if state.has_unsent_update():
            assert len(state.visible_text()) <= len(state.text)
            state.mark_sent()
    return CountingStr.read


def test_a_chunk_costs_its_own_text_and_the_held_end_not_the_whole_text(tokenizer):
    """64 stops of 12 characters over 400 chunks of 5 characters: the scan reads at most each stop's
    search over the chunk plus the held end (< 12 characters) and the held end's lookup, per chunk.
    The full scan read every stop over the whole text at every chunk (64 x 400 x ~1,000 characters,
    ~26 M); and the cost of twice the chunks is about twice, not four times."""
    rnd = random.Random(5)
    stops = [_word(rnd, "abcdefgh ", 12, 12) for _ in range(64)]
    cost = _stream_cost(tokenizer, stops, 400, 5)
    # (a stop's search reads the chunk and at most 11 held characters; the held end's lookup at most
    # 16 positions of 11 characters; x2 for the two reads per chunk, has_unsent_update and the text)
    bound = 400 * (64 * (5 + 11) + 16 * 11) * 2
    assert cost <= bound, (cost, bound)
    assert _stream_cost(tokenizer, stops, 800, 5) <= 2.2 * cost


def _scan_threads(monkeypatch) -> list[tuple[int, int]]:
    """(thread, characters to read) of each stop-string scan that had something to read."""
    calls: list[tuple[int, int]] = []
    scan = StopScan.scan

    def recording(self: StopScan, text: str) -> None:
        if len(text) > self.scanned:
            calls.append((threading.get_ident(), len(text) - self.scanned))
        scan(self, text)

    monkeypatch.setattr(StopScan, "scan", recording)
    return calls


def test_a_large_finish_scan_runs_off_the_event_loop_with_the_same_text(tokenizer, monkeypatch):
    """A non-streamed reply scans its whole text for every stop at once. At the bounds (255 stops of 64
    characters, each 62 'a's then two letters, and "zz", over 16,000 'a's: ~10-30 ms a sample) that
    scan runs on a worker thread while the loop serves a bystander, and gives the text of a scan on the
    loop; a reply at OFF_LOOP_SCAN scans on the loop (a thread hop would cost more than it)."""
    stops = ["a" * 62 + chr(98 + i % 16) + chr(98 + i // 16) for i in range(255)] + ["zz"]
    calls = _scan_threads(monkeypatch)

    def finished_state(text: str) -> ReqState:
        state = make_state(tokenizer, stops)
        feed(state, text, {"type": "stop", "matched": "zz"})
        return state

    async def reply_with_bystander(state: ReqState) -> tuple[dict, int, int]:
        ticks = 0
        done = False

        async def bystander() -> None:
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.create_task(bystander())
        await asyncio.sleep(0)
        before = ticks
        out = await state.reply(lambda ids: [])
        during = ticks - before
        done = True
        await task
        return out, during, threading.get_ident()

    text = "a" * 16_000 + "bzzab"
    out, during, loop_thread = asyncio.run(reply_with_bystander(finished_state(text)))
    assert StopScan(stops).work(text) > OFF_LOOP_SCAN
    assert [n for _, n in calls] == [len(text)] and calls[0][0] != loop_thread, calls
    assert during > 0, "the loop served the bystander while the scan ran"
    on_loop = finished_state(text)
    assert out["text"] == on_loop.to_dict(lambda ids: [])["text"] == full_scan_visible(text, stops, None)
    assert out["text"] == "a" * 16_000 + "b"
    # Under the threshold: the scan stays on the loop.
    calls.clear()
    small = "a" * (OFF_LOOP_SCAN // 256 - 2) + "zz"  # (256 x 256: at the threshold)
    out, during, loop_thread = asyncio.run(reply_with_bystander(finished_state(small)))
    assert [c[0] for c in calls] == [loop_thread] and out["text"] == small[:-2]
