"""The TokenizerManager's half of /pause_generation and /continue_generation: a pause that fails leaves
the server as it was (never silently paused), and continue resumes new requests even when an "abort"
pause never reached the scheduler. Likewise its request gate for /release_memory_occupation."""

from __future__ import annotations

import asyncio

import pytest

from sglang.srt.managers.io_struct import (
    ContinueGenerationReqInput,
    PauseGenerationReqInput,
    PortArgs,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
)
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.server_args import ServerArgs
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=3, suite="per-commit-cpu")

MODEL_INFO = {"context_len": 4096, "max_req_input_len": 4095, "vocab_size": 512, "max_running_requests": 8}


class ScriptedControl:
    """Stands in for the scheduler's control replies: records the requests, times out on demand."""

    def __init__(self, fail: bool):
        self.fail = fail
        self.sent: list[type] = []

    async def __call__(self, req, reply_type, timeout):
        self.sent.append(type(req))
        if self.fail:
            raise TimeoutError("The scheduler did not answer.")


@pytest.fixture
def tm():
    manager = TokenizerManager(ServerArgs(model_path="tiny-qwen3-next"), PortArgs.init_new(), MODEL_INFO)
    yield manager
    manager.encoder.close()


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_a_failed_pause_leaves_the_server_unpaused(tm, mode):
    tm._control = ScriptedControl(fail=True)
    with pytest.raises(TimeoutError):
        asyncio.run(tm.pause_generation(mode, timeout=0.1))
    assert tm._unpaused.is_set(), "new requests would wait forever"


def test_continue_after_an_abort_pause_does_not_ask_the_scheduler(tm):
    control = tm._control = ScriptedControl(fail=True)  # the scheduler would not answer
    asyncio.run(tm.pause_generation("abort", timeout=0.1))  # nothing runs: done at once
    assert not tm._unpaused.is_set()
    asyncio.run(tm.continue_generation(timeout=0.1))
    assert tm._unpaused.is_set() and control.sent == []


def test_pause_and_continue_reach_the_scheduler(tm):
    control = tm._control = ScriptedControl(fail=False)
    asyncio.run(tm.pause_generation("in_place"))
    assert not tm._unpaused.is_set()
    asyncio.run(tm.pause_generation("abort"))  # a second pause keeps the scheduler's
    asyncio.run(tm.continue_generation())
    assert tm._unpaused.is_set()
    assert control.sent == [PauseGenerationReqInput, ContinueGenerationReqInput]


class ScriptedMemoryReplies:
    """The scheduler's replies to release/resume, each saying which tags are released after it."""

    def __init__(self, released_after: list[list[str] | None]):
        self.released_after = list(released_after)

    async def __call__(self, req, reply_type, timeout):
        await asyncio.sleep(0)
        released = self.released_after.pop(0)
        if released is None:
            raise TimeoutError("The scheduler did not answer.")
        return reply_type(True, "", released)


def test_the_request_gate_follows_what_is_released(tm):
    """Closed from before a release is sent until the scheduler says nothing is released; calls that
    overlap run one at a time, so the last reply decides (an earlier resume's could open it otherwise)."""
    release, resume = ReleaseMemoryOccupationReqInput(None), ResumeMemoryOccupationReqInput(None)
    tm._control = ScriptedMemoryReplies([["cuda_graph", "kv_cache", "weights"], ["kv_cache"], [], None])

    async def scenario():
        seen = []
        await tm.release_memory_occupation(release)
        seen.append(tm._memory_resumed.is_set())
        await tm.resume_memory_occupation(ResumeMemoryOccupationReqInput(["weights", "cuda_graph"]))
        seen.append(tm._memory_resumed.is_set())
        await tm.resume_memory_occupation(resume)
        seen.append(tm._memory_resumed.is_set())
        with pytest.raises(TimeoutError):  # the scheduler cannot say: requests go through (and fail)
            await tm.release_memory_occupation(release)
        seen.append(tm._memory_resumed.is_set())
        return seen

    assert asyncio.run(scenario()) == [False, False, True, True]

    # A resume in flight when a release comes: the release's reply, last, keeps the gate closed.
    tm._control = ScriptedMemoryReplies([[], ["weights"]])

    async def overlapping():
        await asyncio.gather(tm.resume_memory_occupation(resume), tm.release_memory_occupation(release))
        return tm._memory_resumed.is_set()

    assert asyncio.run(overlapping()) is False
