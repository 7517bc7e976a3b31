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
import copy
import time
from types import SimpleNamespace

import pytest

import sglang
from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import GenerateReqInput, OpenSessionReqInput
from sglang.srt.managers.request_validation import Prompts, RequestError
from sglang.srt.managers.session_controller import SessionController
from sglang.srt.managers.text_encoder import Encoded
from sglang.test import fake_scheduler
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")

BOS = 1
LIMITS = SimpleNamespace(auto_truncate=False, context_len=10_000, max_req_input_len=10_000)


def build(ctrl: SessionController, params, *ids_lists: list[int]):
    prompts = Prompts([], [list(x) for x in ids_lists], len(ids_lists) > 1)
    return ctrl.build_prompts(params, prompts, [], False, LIMITS), prompts.ids


def item(plan, rid: str, ids: list[int], max_new: int = 4) -> SimpleNamespace:
    """What `begin` reads of a `NormalizedRequest`."""
    params = SimpleNamespace(max_new_tokens=max_new)
    return SimpleNamespace(session=plan, req=SimpleNamespace(rid=rid, input_ids=ids, sampling_params=params))


def turn(ctrl: SessionController, params, ids: list[int], rid: str, output: list[int] | None = None):
    """Build, send and (with `output`) end one turn: its plan, its whole prompt, the rids to abort."""
    plans, full = build(ctrl, params, ids)
    aborted = ctrl.begin([item(plans[0], rid, full[0])])
    if output is not None:
        ctrl.end(plans[0], output)
    return plans[0], full[0], aborted


def refused(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args)
    return e.value


def held(ctrl: SessionController) -> tuple[int, int]:
    """The accounting, checked against the live turns it counts."""
    turns = [t for s in ctrl.sessions.values() for t in s.turns.values()]
    assert ctrl.num_turns == len(turns)
    assert ctrl.num_tokens == sum(len(t.own) + t.reserved for t in turns)
    return ctrl.num_turns, ctrl.num_tokens


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
    assert turn(ctrl, {**s, "rid": "t3", "offset": -2}, [18], "t8", [])[1] == [BOS, 10, 11, 20, 21, 12, 18]
    # An offset before the start leaves no history, and a continuation's BOS still goes (upstream's rule).
    assert turn(ctrl, {**s, "rid": "t1", "offset": -10}, [BOS, 19], "t9", [])[1] == [19]
    # A batch: one object for every prompt, or one per prompt (null or {}: that prompt is no turn).
    plans, full = build(ctrl, [{**s, "rid": "t1"}, None, {}], [30], [31], [32])
    assert full == [[BOS, 10, 11, 20, 21, 30], [31], [32]] and plans[1:] == [None, None]
    plans, full = build(ctrl, {**s, "rid": "t1"}, [30], [31])
    assert full == [[BOS, 10, 11, 20, 21, 30], [BOS, 10, 11, 20, 21, 31]]
    assert build(ctrl, {}, [33]) == ([None], [[33]])  # upstream reads an empty object as no session
    assert held(ctrl) == (9, 3 + 2 + 2 + 1 + 1 + 1 + 1 + 1 + 1 + 1)  # each turn's own ids only


def test_a_long_conversation_holds_its_history_once():
    """Each turn keeps its own ids and where it branches off: 3 turns of 1,000 new ids hold 3,000 + their
    outputs, not the 6,000 + that whole prompts would (the bound would run out quadratically)."""
    ctrl = SessionController()
    sid = ctrl.open(OpenSessionReqInput())
    parent = None
    for k in range(3):
        params = {"id": sid} if parent is None else {"id": sid, "rid": parent}
        _, full, _ = turn(ctrl, params, list(range(1000 * k, 1000 * (k + 1))), f"t{k}", [7])
        parent = f"t{k}"
    assert len(full) == 3000 + 2 and full[-1001] == 7
    assert held(ctrl) == (3, 3003)
    assert ctrl.sessions[sid].turns["t2"].prefix(3003) == full + [7]


def test_replace_forgets_the_later_turns_and_names_the_running_ones():
    ctrl = SessionController()
    sid = ctrl.open(OpenSessionReqInput(session_id="s"))
    s = {"id": sid}
    turn(ctrl, s, [10], "t1", [20])
    turn(ctrl, {**s, "rid": "t1"}, [11], "t2", [21])
    running, _, _ = turn(ctrl, {**s, "rid": "t2"}, [12], "t3")  # not ended: still running
    sibling, _, _ = turn(ctrl, {**s, "rid": "t1"}, [13], "t4", [23])
    assert held(ctrl) == (4, 2 + 2 + (1 + 4) + 2)  # the running one counts its max_new_tokens
    _, full, aborted = turn(ctrl, {**s, "rid": "t1", "replace": True}, [14], "t5", [24])
    assert full == [10, 20, 14] and aborted == ["t3"]
    assert sorted(ctrl.sessions[sid].turns) == ["t1", "t5"]
    e = refused(build, ctrl, {**s, "rid": "t2"}, [1])
    assert e.param == "session_params.rid" and "'t2'" in e.message
    assert held(ctrl) == (2, 4)
    ctrl.end(running, [99, 98])  # the aborted turn's end counts nowhere
    assert held(ctrl) == (2, 4) and ctrl.sessions[sid].running == 0
    # No rid: every turn goes (the running ones named).
    turn(ctrl, {**s, "rid": "t5"}, [15], "t6")
    _, full, aborted = turn(ctrl, {**s, "replace": True}, [16], "t7", [])
    assert full == [16] and aborted == ["t6"] and sorted(ctrl.sessions[sid].turns) == ["t7"]
    assert held(ctrl) == (1, 1)
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
    prompts = Prompts([], [[1]], False)
    assert (
        refused(ctrl.build_prompts, {"id": sid}, prompts, [], True, LIMITS).param == "session_params"
    )  # media
    # The whole prompt is checked against the context, named as the client sent its part.
    short = SimpleNamespace(auto_truncate=False, context_len=3, max_req_input_len=3)
    prompts = Prompts(["hi"], [None], False)
    e = refused(ctrl.build_prompts, {"id": sid, "rid": "done"}, prompts, [Encoded([5, 6], 2)], False, short)
    assert e.param == "text" and "4 tokens" in e.message
    plans, full = build(ctrl, {"id": sid, "rid": "done"}, [1])
    assert refused(ctrl.begin, [item(plans[0], "done", full[0])]).param == "rid"  # a rid the session has
    # replace in a request of several turns (prompts or samples): they would replace each other.
    plans, full = build(ctrl, {"id": sid, "replace": True}, [1])
    samples = [item(copy.copy(plans[0]), f"r-{j}", full[0]) for j in range(2)]
    assert refused(ctrl.begin, samples).param == "session_params.replace"
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
    e = refused(ctrl.begin, [item(plans[0], "t4", full[0])])
    assert e.param == "session_params.rid" and "replaced" in e.message
    plans, full = build(ctrl, {"id": sid, "rid": "t3"}, [14])
    assert ctrl.close(sid) and not ctrl.close(sid)
    e = refused(ctrl.begin, [item(plans[0], "t5", full[0])])
    assert e.param == "session_params.id" and "closed" in e.message
    ctrl.open(OpenSessionReqInput(session_id=sid))  # the same id again: still not the session it was built in
    assert refused(ctrl.begin, [item(plans[0], "t5", full[0])]).param == "session_params.id"
    assert held(ctrl) == (0, 0)


def test_the_bounds_count_what_running_turns_may_add_and_closing_gives_everything_back():
    with (
        envs.SGLANG_MAX_OPEN_SESSIONS.override(2),
        envs.SGLANG_SESSION_MAX_TOKENS.override(25),
        envs.SGLANG_SESSION_MAX_REQUESTS.override(3),
    ):
        ctrl = SessionController()
    a, b = ctrl.open(OpenSessionReqInput()), ctrl.open(OpenSessionReqInput())
    assert "SGLANG_MAX_OPEN_SESSIONS" in refused(ctrl.open, OpenSessionReqInput()).message
    plans, full = build(ctrl, {"id": a}, [1] * 6)
    running = item(plans[0], "a1", full[0], max_new=10)
    ctrl.begin([running])  # 6 + 10 of 25
    plans, full = build(ctrl, {"id": b}, [3] * 6)  # 6 + 4 more: over, though no output came yet
    assert "SGLANG_SESSION_MAX_TOKENS" in refused(ctrl.begin, [item(plans[0], "b1", full[0])]).message
    ctrl.end(running.session, [2] * 12)  # more than it reserved: kept to its max_new_tokens
    assert held(ctrl) == (1, 16)
    ctrl.begin([item(plans[0], "b1", full[0], max_new=2)])
    assert held(ctrl) == (2, 24)
    plans, full = build(ctrl, {"id": b}, [3])
    ctrl.begin([item(plans[0], "b2", full[0], max_new=0)])
    plans, full = build(ctrl, {"id": b}, [3])  # a fourth request (and one token too many)
    assert "SGLANG_SESSION_MAX_REQUESTS" in refused(ctrl.begin, [item(plans[0], "b3", full[0], 0)]).message
    # A replace frees what it forgets first: at the bound, a client can still roll its session back.
    plans, full = build(ctrl, {"id": b, "replace": True}, [3] * 8)
    assert ctrl.begin([item(plans[0], "b4", full[0], max_new=1)]) == ["b1", "b2"]
    assert held(ctrl) == (2, 16 + 9)
    assert ctrl.close(a) and ctrl.close(b)
    assert held(ctrl) == (0, 0) and not ctrl.sessions


def test_a_session_times_out_only_idle():
    """`timeout` counts from the last request sent or ended, and never while one runs."""
    ctrl = SessionController()
    idle = ctrl.open(OpenSessionReqInput(timeout=0.05))
    busy = ctrl.open(OpenSessionReqInput(timeout=0.05))
    turn(ctrl, {"id": idle}, [1, 2], "x", [3])
    running, _, _ = turn(ctrl, {"id": busy}, [1, 2], "y")
    time.sleep(0.1)
    assert refused(build, ctrl, {"id": idle, "rid": "x"}, [4]).param == "session_params.id"
    assert list(ctrl.sessions) == [busy]
    ctrl.end(running, [5])
    assert build(ctrl, {"id": busy, "rid": "y"}, [4])[1] == [[1, 2, 5, 4]]  # ended just now: not idle
    assert held(ctrl) == (1, 3)


def test_each_session_runs_on_one_replica_and_sessions_take_turns():
    ctrl = SessionController(dp_size=2)
    sids = [ctrl.open(OpenSessionReqInput()) for _ in range(3)]
    assert [ctrl.sessions[s].dp_rank for s in sids] == [0, 1, 0]
    plans, full = build(ctrl, {"id": sids[1]}, [1])
    sent = item(plans[0], "z", full[0])
    ctrl.begin([sent])
    assert sent.req.routed_dp_rank == 1
    assert SessionController().open(OpenSessionReqInput(session_id="one")) == "one"


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
    u2 = tm.sessions.sessions[sid].turns["u2"]
    u2_len = len(u2)
    assert u2.prefix(len(u2)) == prompt + first["output_ids"] + [7, 8] + second["output_ids"]
    # n > 1: each sample is a turn of its own, with its own output (they shared one record, and one
    # sample stayed unfinished forever while the other kept the first one's output).
    sampled = {"max_new_tokens": 3, "temperature": 1.0, "n": 2, "sampling_seed": 5, "ignore_eos": True}
    outs = engine.generate(
        input_ids=[9], sampling_params=sampled, rid="s", session_params={"id": sid, "rid": "u2"}
    )
    assert outs[0]["output_ids"] != outs[1]["output_ids"]
    for j, out in enumerate(outs):
        t = tm.sessions.sessions[sid].turns[f"s-{j}"]
        assert t.done and t.prefix(len(t)) == u2.prefix(len(u2)) + [9] + out["output_ids"]
    assert (
        engine.generate(input_ids=[9], sampling_params=greedy, session_params={})["meta_info"][
            "prompt_tokens"
        ]
        == 1
    )

    async def continue_on_the_finished_chunk() -> dict:
        """A streaming client continues as soon as it reads the last chunk, before its call returns (the
        turn counted as running until then: a 400)."""
        params = {"id": sid, "rid": "u2"}
        obj = GenerateReqInput(
            input_ids=[4], sampling_params=greedy, rid="st", stream=True, session_params=params
        )
        stream = tm.generate_request(obj)
        try:
            async for chunk in stream:
                if chunk["meta_info"]["finish_reason"] is not None:
                    params = {"id": sid, "rid": "st"}
                    more = GenerateReqInput(input_ids=[3], sampling_params=greedy, session_params=params)
                    return await _first(tm.generate_request(more))
        finally:
            await stream.aclose()

    assert engine._run(continue_on_the_finished_chunk())["meta_info"]["prompt_tokens"] == u2_len + 1 + 4 + 1

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
    assert sorted(tm.sessions.sessions[sid].turns) == [
        "u1",
        "u2",
        "u4",
    ]  # (the samples went with u2's later turns)

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
