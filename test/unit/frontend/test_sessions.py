"""Sessions (upstream's /open_session, /close_session, session_params): the prompt a turn is built into
(history as upstream builds it: the parent's input and output ids, `drop_previous_output`, `offset`, a
leading BOS dropped), `replace` (the later turns forgotten, the running ones named for abort), every
refusal naming its field, a close or replace that comes between a request's build and its send, the bounds
and their accounting back to zero, the timeout; then through the TokenizerManager against the fake
scheduler: a text turn's outputs recorded, a replace aborting a running turn, a close while a request
waits at the pause gate. The real model's continuation (equal to the whole prompt sent at once, from the
prefix cache) is checked over HTTP in test_openai_api.py."""

from __future__ import annotations

import asyncio
import time

import pytest

import sglang
from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import GenerateReqInput, OpenSessionReqInput
from sglang.srt.managers.request_validation import Prompts, RequestError
from sglang.srt.managers.session_controller import SessionController
from sglang.test import fake_scheduler
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")

BOS = 1


def build(ctrl: SessionController, params, *ids_lists: list[int]):
    prompts = Prompts([], [list(x) for x in ids_lists], len(ids_lists) > 1)
    return ctrl.build_prompts(params, prompts, [], media=False), prompts.ids


def turn(ctrl: SessionController, params, ids: list[int], rid: str, output: list[int] | None = None):
    """Build, send and (with `output`) end one turn: its plan, its whole prompt, the rids to abort."""
    plans, full = build(ctrl, params, ids)
    aborted = ctrl.begin(plans, [rid], full)
    if output is not None:
        ctrl.end(plans[0], output)
    return plans[0], full[0], aborted


def refused(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return e.value


def test_a_turn_is_its_parents_ids_then_its_own_as_upstream_builds_them():
    ctrl = SessionController(bos_token_id=BOS)
    sid = ctrl.open(OpenSessionReqInput())
    s = {"id": sid}
    assert turn(ctrl, s, [BOS, 10, 11], "t1", [20, 21])[1] == [BOS, 10, 11]  # a root keeps its BOS
    assert turn(ctrl, {**s, "rid": "t1"}, [BOS, 12], "t2", [22])[1] == [BOS, 10, 11, 20, 21, 12]
    assert turn(ctrl, {**s, "rid": "t2"}, [13], "t3", [])[1] == [BOS, 10, 11, 20, 21, 12, 22, 13]
    drop = {**s, "rid": "t2", "drop_previous_output": True}
    assert turn(ctrl, drop, [14], "t4", [])[1] == [BOS, 10, 11, 20, 21, 12, 14]
    assert turn(ctrl, {**s, "rid": "t1", "offset": -1}, [15], "t5", [])[1] == [BOS, 10, 11, 20, 15]
    assert turn(ctrl, {**s, "rid": "t1", "offset": 2}, [16], "t6", [])[1] == [BOS, 10, 16]
    assert turn(ctrl, {**s, "rid": "t1", "offset": 0}, [17], "t7", [])[1] == [BOS, 10, 11, 20, 21, 17]
    # A batch: one object for every prompt, or one per prompt (null: that prompt is no turn).
    plans, full = build(ctrl, [{**s, "rid": "t1"}, None], [30], [31])
    assert full == [[BOS, 10, 11, 20, 21, 30], [31]] and plans[1] is None
    plans, full = build(ctrl, {**s, "rid": "t1"}, [30], [31])
    assert full == [[BOS, 10, 11, 20, 21, 30], [BOS, 10, 11, 20, 21, 31]]
    assert ctrl.num_turns == 7 and ctrl.num_tokens == sum(
        len(t.ids) for t in ctrl.sessions[sid].turns.values()
    )


def test_replace_forgets_the_later_turns_and_names_the_running_ones():
    ctrl = SessionController()
    sid = ctrl.open(OpenSessionReqInput(session_id="s"))
    s = {"id": sid}
    turn(ctrl, s, [10], "t1", [20])
    turn(ctrl, {**s, "rid": "t1"}, [11], "t2", [21])
    running, _, _ = turn(ctrl, {**s, "rid": "t2"}, [12], "t3")  # not ended: still running
    sibling, _, _ = turn(ctrl, {**s, "rid": "t1"}, [13], "t4", [23])
    _, full, aborted = turn(ctrl, {**s, "rid": "t1", "replace": True}, [14], "t5", [24])
    assert full == [10, 20, 14] and aborted == ["t3"]
    assert sorted(ctrl.sessions[sid].turns) == ["t1", "t5"]
    e = refused(build, ctrl, {**s, "rid": "t2"}, [1])
    assert e.param == "session_params.rid" and "'t2'" in e.message
    assert (ctrl.num_turns, ctrl.num_tokens) == (2, 2 + 3 + 1)
    ctrl.end(running, [99, 98])  # the aborted turn's end counts nowhere
    assert (ctrl.num_turns, ctrl.num_tokens) == (2, 6)
    # No rid: every turn goes (the running ones named).
    turn(ctrl, {**s, "rid": "t5"}, [15], "t6")
    _, full, aborted = turn(ctrl, {**s, "replace": True}, [16], "t7", [])
    assert full == [16] and aborted == ["t6"] and sorted(ctrl.sessions[sid].turns) == ["t7"]
    assert (ctrl.num_turns, ctrl.num_tokens) == (1, 1)
    assert not sibling.turn.live


def test_every_refusal_names_its_field():
    ctrl = SessionController()
    sid = ctrl.open(OpenSessionReqInput(session_id="s"))
    turn(ctrl, {"id": sid}, [10], "done", [20])
    turn(ctrl, {"id": sid}, [10], "running")
    cases = [
        ({"id": sid, "ridd": "x"}, "session_params.ridd"),
        ({"rid": "done"}, "session_params.id"),
        ({"id": "nope"}, "session_params.id"),
        ({"id": sid, "rid": 5}, "session_params.rid"),
        ({"id": sid, "rid": "done", "offset": "1"}, "session_params.offset"),
        ({"id": sid, "rid": "done", "offset": True}, "session_params.offset"),
        ({"id": sid, "replace": "yes"}, "session_params.replace"),
        ({"id": sid, "drop_previous_output": 1}, "session_params.drop_previous_output"),
        ({"id": sid, "rid": "nope"}, "session_params.rid"),
        ({"id": sid, "rid": "running"}, "session_params.rid"),
        ("s", "session_params"),
        ([{"id": sid}, {"id": sid}], "session_params"),  # two for one prompt
    ]
    for params, param in cases:
        assert refused(build, ctrl, params, [1]).param == param, params
    assert refused(build, ctrl, {"id": sid, "replace": True}, [1], [2]).param == "session_params.replace"
    prompts = Prompts([], [[1]], False)
    assert refused(ctrl.build_prompts, {"id": sid}, prompts, [], True).param == "session_params"  # media
    plans, full = build(ctrl, {"id": sid, "rid": "done"}, [1])
    assert refused(ctrl.begin, plans, ["done"], full).param == "rid"  # a rid the session has already
    for obj, param in [
        (OpenSessionReqInput(session_id="s"), "session_id"),  # open already
        (OpenSessionReqInput(session_id=""), "session_id"),
        (OpenSessionReqInput(session_id="x" * 257), "session_id"),
        (OpenSessionReqInput(session_id="a\nb"), "session_id"),
        (OpenSessionReqInput(streaming=True), "streaming"),
        (OpenSessionReqInput(timeout=0), "timeout"),
        (OpenSessionReqInput(timeout=float("inf")), "timeout"),
        (OpenSessionReqInput(capacity_of_str_len=-1), "capacity_of_str_len"),
        (OpenSessionReqInput(capacity_of_str_len=True), "capacity_of_str_len"),
    ]:
        assert refused(ctrl.open, obj).param == param, obj
    pd = SessionController(refusal="Sessions are not supported with --disaggregation-mode.")
    assert "--disaggregation-mode" in refused(pd.open, OpenSessionReqInput()).message


def test_a_close_or_replace_between_build_and_send_is_refused_at_send():
    """The TokenizerManager builds a request's prompt, then may wait (tokenizing, media, a pause) before
    it sends it: a close or a replace meanwhile must refuse it, not record a turn in a closed session or
    under a forgotten parent."""
    ctrl = SessionController()
    sid = ctrl.open(OpenSessionReqInput(session_id="s"))
    turn(ctrl, {"id": sid}, [10], "t1", [20])
    turn(ctrl, {"id": sid, "rid": "t1"}, [11], "t2", [21])
    plans, full = build(ctrl, {"id": sid, "rid": "t2"}, [12])
    turn(ctrl, {"id": sid, "rid": "t1", "replace": True}, [13], "t3", [])  # forgets t2
    e = refused(ctrl.begin, plans, ["t4"], full)
    assert e.param == "session_params.rid" and "replaced" in e.message
    plans, full = build(ctrl, {"id": sid, "rid": "t3"}, [14])
    assert ctrl.close(sid) and not ctrl.close(sid)
    e = refused(ctrl.begin, plans, ["t5"], full)
    assert e.param == "session_params.id" and "closed" in e.message
    ctrl.open(OpenSessionReqInput(session_id=sid))  # the same id again: still not the session it was built in
    assert refused(ctrl.begin, plans, ["t5"], full).param == "session_params.id"
    assert (ctrl.num_turns, ctrl.num_tokens) == (0, 0)


def test_the_bounds_refuse_with_their_names_and_closing_gives_everything_back():
    with (
        envs.SGLANG_MAX_OPEN_SESSIONS.override(2),
        envs.SGLANG_SESSION_MAX_TOKENS.override(10),
        envs.SGLANG_SESSION_MAX_REQUESTS.override(3),
    ):
        ctrl = SessionController()
    a, b = ctrl.open(OpenSessionReqInput()), ctrl.open(OpenSessionReqInput())
    assert "SGLANG_MAX_OPEN_SESSIONS" in refused(ctrl.open, OpenSessionReqInput()).message
    turn(ctrl, {"id": a}, [1] * 6, "a1", [2, 2])
    plans, full = build(ctrl, {"id": b}, [3] * 3)  # 8 + 3 > 10 tokens
    assert "SGLANG_SESSION_MAX_TOKENS" in refused(ctrl.begin, plans, ["b1"], full).message
    turn(ctrl, {"id": b}, [3], "b1", [])
    turn(ctrl, {"id": b}, [3], "b2", [])
    plans, full = build(ctrl, {"id": b}, [3])  # a fourth request
    assert "SGLANG_SESSION_MAX_REQUESTS" in refused(ctrl.begin, plans, ["b3"], full).message
    assert ctrl.close(a) and ctrl.close(b)
    assert (ctrl.num_turns, ctrl.num_tokens, len(ctrl.sessions)) == (0, 0, 0)


def test_a_session_idle_past_its_timeout_closes():
    ctrl = SessionController()
    idle = ctrl.open(OpenSessionReqInput(timeout=0.05))
    busy = ctrl.open(OpenSessionReqInput(timeout=60))
    turn(ctrl, {"id": idle}, [1, 2], "x", [3])
    time.sleep(0.1)
    assert refused(build, ctrl, {"id": idle, "rid": "x"}, [4]).param == "session_params.id"
    assert list(ctrl.sessions) == [busy] and (ctrl.num_turns, ctrl.num_tokens) == (0, 0)


@pytest.fixture(scope="module")
def engine():
    with envs.SGLANG_TEST_FORWARD_DELAY_MS.override(5):
        eng = sglang.Engine(
            scheduler_entry=fake_scheduler.run_scheduler_process, model_path="tiny-qwen3-next"
        )
    yield eng
    eng.shutdown()


def test_turns_through_the_tokenizer_manager(engine):
    tm = engine.tokenizer_manager
    sid = engine.open_session(capacity_of_str_len=100, session_id="chat")
    greedy = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = engine.generate("Hello there", greedy, rid="u1", session_params={"id": sid})
    prompt = tm.tokenizer.encode("Hello there")
    second = engine.generate(
        input_ids=[7, 8], sampling_params=greedy, rid="u2", session_params={"id": sid, "rid": "u1"}
    )
    assert second["meta_info"]["prompt_tokens"] == len(prompt) + 4 + 2
    assert (
        tm.sessions.sessions[sid].turns["u2"].ids.tolist()
        == prompt + first["output_ids"] + [7, 8] + second["output_ids"]
    )

    async def replace_a_running_turn() -> tuple[dict, dict]:
        long = {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True}  # ~2 s of 5 ms steps
        obj = GenerateReqInput(
            input_ids=[9], sampling_params=long, rid="u3", session_params={"id": sid, "rid": "u2"}
        )
        running = asyncio.create_task(_first(tm.generate_request(obj)))
        await asyncio.sleep(0.3)
        again = GenerateReqInput(
            input_ids=[5],
            sampling_params=greedy,
            rid="u4",
            session_params={"id": sid, "rid": "u2", "replace": True},
        )
        replacing = await _first(tm.generate_request(again))
        return await asyncio.wait_for(running, 10), replacing

    aborted, replacing = engine._run(replace_a_running_turn())
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort", (
        len(aborted["output_ids"]),
        aborted["meta_info"],
    )
    assert len(aborted["output_ids"]) < 400
    assert replacing["meta_info"]["finish_reason"]["type"] == "length"
    assert sorted(tm.sessions.sessions[sid].turns) == ["u1", "u2", "u4"]

    async def close_while_paused() -> BaseException | None:
        await tm.pause_generation("abort")
        obj = GenerateReqInput(input_ids=[6], sampling_params=greedy, session_params={"id": sid, "rid": "u4"})
        waiting = asyncio.create_task(_first(tm.generate_request(obj)))
        await asyncio.sleep(0.2)  # built, and held at the gate
        engine_close = tm.sessions.close(sid)
        await tm.continue_generation()
        result = await asyncio.wait_for(asyncio.gather(waiting, return_exceptions=True), 10)
        assert engine_close
        return result[0]

    error = engine._run(close_while_paused())
    assert isinstance(error, RequestError) and error.param == "session_params.id", error
    assert (tm.sessions.num_turns, tm.sessions.num_tokens) == (0, 0)
    assert tm.rid_to_state == {}


async def _first(agen):
    try:
        return await agen.__anext__()
    finally:
        await agen.aclose()
