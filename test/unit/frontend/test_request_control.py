"""Scheduler-side request control on a real in-process scheduler: upstream's waiting and running
deadlines abort with 503 and release everything; pausing with "retract" gives every slot back and
"in_place" keeps requests as they are; both continue to a full answer."""

from __future__ import annotations

import pytest

from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import (
    ContinueGenerationReqInput,
    PauseGenerationReqInput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.scheduler_components.request_control import (
    RUNNING_TIMEOUT_MESSAGE,
    WAITING_TIMEOUT_MESSAGE,
)
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import Output, SchedulerHarness, token_ids

register_cpu_ci(est_time=12, suite="per-commit-cpu")


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def send(h: SchedulerHarness, rid: str, ids: list[int], max_new_tokens: int) -> None:
    """Through the scheduler's input dispatch, as the TokenizerManager's messages arrive."""
    params = SamplingParams.from_dict(
        {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    )
    h.sched.process_input_requests([TokenizedGenerateReqInput(rid, None, ids, params)])
    h.outputs[rid] = Output(rid)


def held_by_requests(h: SchedulerHarness) -> tuple[int, int]:
    state = h.sched.get_internal_state()
    return state["token_usage"]["held_by_requests"], state["mamba_usage"]["held_by_requests"]


@pytest.fixture
def deadline_harness():
    with envs.SGLANG_REQ_WAITING_TIMEOUT.override(1.0), envs.SGLANG_REQ_RUNNING_TIMEOUT.override(2.0):
        h = SchedulerHarness(max_running_requests=1, mamba_scheduler_strategy="extra_buffer_lazy")
    yield h
    h.shutdown()


def test_deadlines_abort_with_503_and_release_everything(deadline_harness):
    h = deadline_harness
    clock = FakeClock()
    h.sched.request_deadlines.clock = clock
    send(h, "a", token_ids(40, seed=1), 500)
    send(h, "b", token_ids(40, seed=2), 4)
    for _ in range(3):
        h.sched.step()
    h.sched.request_deadlines.check()  # "a" is seen running at t=100; "b" waits (one may run)
    clock.now += 0.9
    h.sched.request_deadlines.check()
    h.collect()
    assert h.outputs["b"].finished_reason is None, "not late yet"

    clock.now += 0.2  # b: 1.1 s without admission
    h.sched.request_deadlines.check()
    h.collect()
    assert h.outputs["b"].finished_reason == {
        "type": "abort",
        "message": WAITING_TIMEOUT_MESSAGE,
        "status_code": 503,
    }
    assert h.outputs["a"].finished_reason is None

    h.sched.step()
    clock.now += 1.0  # a: 2.1 s since it was first seen running
    h.sched.request_deadlines.check()
    h.collect()
    assert h.outputs["a"].finished_reason == {
        "type": "abort",
        "message": RUNNING_TIMEOUT_MESSAGE,
        "status_code": 503,
    }
    assert len(h.outputs["a"].output_ids) < 500
    h.run()
    assert held_by_requests(h) == (0, 0)
    h.flush_and_check_empty()


def test_deadlines_are_off_by_default():
    h = SchedulerHarness()
    try:
        assert not h.sched.request_deadlines.enabled
    finally:
        h.shutdown()


@pytest.fixture(scope="module")
def harness():
    h = SchedulerHarness(mamba_scheduler_strategy="extra_buffer_lazy")
    yield h
    h.shutdown()


def test_pause_retract_frees_every_slot_and_continue_finishes(harness):
    h = harness
    send(h, "r0", token_ids(50, seed=3), 30)
    send(h, "r1", token_ids(70, seed=4), 30)
    for _ in range(4):
        h.sched.step()
    assert h.sched.running and h.sched.in_flight
    h.sched.process_input_requests([PauseGenerationReqInput("retract")])
    assert h.sched.generation_pause.paused
    assert not h.sched.running and not h.sched.in_flight and h.sched.chunked_req is None
    assert [r.rid for r in h.sched.waiting_queue] == ["r0", "r1"]
    assert held_by_requests(h) == (0, 0)
    h.sched.process_input_requests([ContinueGenerationReqInput()])
    assert not h.sched.generation_pause.paused
    h.run()
    for rid in ("r0", "r1"):
        out = h.outputs[rid]
        assert out.finished_reason == {"type": "length", "length": 30}, out
        assert len(out.output_ids) == 30
    h.flush_and_check_empty()


def test_pause_in_place_keeps_requests_as_they_are(harness):
    h = harness
    send(h, "p0", token_ids(30, seed=5), 20)
    for _ in range(3):
        h.sched.step()
    running, in_flight = list(h.sched.running), len(h.sched.in_flight)
    held = held_by_requests(h)
    h.sched.process_input_requests([PauseGenerationReqInput("in_place")])
    assert h.sched.generation_pause.paused
    assert h.sched.running == running and len(h.sched.in_flight) == in_flight
    assert held_by_requests(h) == held and held != (0, 0)
    h.sched.process_input_requests([ContinueGenerationReqInput()])
    h.run()
    assert h.outputs["p0"].finished_reason == {"type": "length", "length": 20}
    h.flush_and_check_empty()
