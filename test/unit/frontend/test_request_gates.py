"""Races at the TokenizerManager's gates, against the fake scheduler: two requests with one rid that both
waited out a pause give one clean 400 naming rid and one full answer (the rid was checked before the
gate and registered after it: one was wrongly aborted and the other hung); a second
/init_weights_update_group while a join waits is answered at once (it queued behind the first for up
to the group's 30 min); and bystanders are not held by either."""

from __future__ import annotations

import asyncio
import time

import pytest

import sglang
from sglang.srt.environ import envs
from sglang.srt.managers.io_struct import GenerateReqInput, InitWeightsUpdateGroupReqInput
from sglang.srt.managers.request_validation import RequestError
from sglang.test import fake_scheduler
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=12, suite="per-commit-cpu")

# A bystander's answer of 4 tokens takes ~4 fake steps of 10 ms: 2 s bounds it with room for a loaded
# 2-core machine, and is far below what the races cost before (a hang until the client's timeout).
BYSTANDER_BOUND_S = 2.0


@pytest.fixture(scope="module")
def engine():
    with envs.SGLANG_TEST_FORWARD_DELAY_MS.override(10):
        eng = sglang.Engine(
            scheduler_entry=fake_scheduler.run_scheduler_process, model_path="tiny-qwen3-next"
        )
    yield eng
    eng.shutdown()


async def answer(tm, rid: str | None = None) -> dict:
    obj = GenerateReqInput(
        input_ids=[5, 6, 7], rid=rid, sampling_params={"max_new_tokens": 4, "temperature": 0}
    )
    gen = tm.generate_request(obj)
    try:
        return await gen.__anext__()
    finally:
        await gen.aclose()


def test_a_duplicate_rid_across_a_pause_is_refused_and_the_first_completes(engine):
    tm = engine.tokenizer_manager

    async def scenario() -> tuple[list, float]:
        await tm.pause_generation("abort")
        both = [asyncio.create_task(answer(tm, "victim-1")) for _ in range(2)]
        await asyncio.sleep(0.2)  # both are past the rid's first look and wait at the gate
        await tm.continue_generation()
        start = time.monotonic()
        results = await asyncio.wait_for(asyncio.gather(*both, return_exceptions=True), 10)
        return results, time.monotonic() - start

    results, took = engine._run(scenario())
    errors = [r for r in results if isinstance(r, BaseException)]
    answers = [r for r in results if not isinstance(r, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], RequestError), results
    assert errors[0].param == "rid" and "victim-1" in errors[0].message
    assert answers[0]["meta_info"]["finish_reason"]["type"] == "length"
    assert len(answers[0]["output_ids"]) == 4
    assert took < BYSTANDER_BOUND_S, took
    assert tm.rid_to_state == {}, "nothing is left registered"


def test_a_second_group_join_is_answered_at_once_and_generation_goes_on(engine):
    """The fake scheduler never answers a join, as a real one waits for a trainer that does not come."""
    tm = engine.tokenizer_manager
    join = InitWeightsUpdateGroupReqInput("127.0.0.1", 29999, 1, 2)

    async def scenario() -> tuple[tuple[bool, str], float, dict]:
        first = asyncio.create_task(tm.init_weights_update_group(join))
        await asyncio.sleep(0.1)
        try:
            second = await asyncio.wait_for(tm.init_weights_update_group(join), 1.0)
            start = time.monotonic()
            bystander = await asyncio.wait_for(answer(tm), 10)
            return second, time.monotonic() - start, bystander
        finally:
            first.cancel()

    (ok, message), took, bystander = engine._run(scenario())
    assert not ok and "being joined already" in message
    assert bystander["meta_info"]["finish_reason"]["type"] == "length"
    assert took < BYSTANDER_BOUND_S, took
