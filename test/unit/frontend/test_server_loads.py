"""Upstream's load routes (`server_loads.py`): `GET /get_load` (the list sglang-router's load-aware
policies poll; `num_tokens` is their load) and `GET /v1/loads` (per replica, an aggregate, `dp_rank`,
`include`, `format=prometheus`), read from a real scheduler's internal state with requests running and
waiting, one replica and two (the data-parallel controller's merge); bad query values are 400s naming
the parameter. The real server: test/registered/openai_server/test_openai_api.py::test_load_routes."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from sglang.srt.entrypoints.server_loads import legacy_loads, v1_loads
from sglang.srt.managers.data_parallel_controller import merge_replies
from sglang.srt.managers.io_struct import GetInternalStateReqOutput
from sglang.test.app_harness import asgi_request, served_app
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=4, suite="per-commit-cpu")


@pytest.fixture(scope="module")
def busy_state():
    """A scheduler with 2 requests running (decoding) and 3 waiting (a 2-request running cap)."""
    h = SchedulerHarness(max_running_requests=2, disable_overlap_schedule=True)
    try:
        for seed in range(5):
            h.submit(token_ids(20 + seed, seed=seed), max_new_tokens=50)
        for _ in range(3):
            h.sched.step()
        yield h.sched.get_internal_state()
    finally:
        h.shutdown()


def test_a_replicas_load_counts_its_requests_and_tokens(busy_state):
    s = busy_state
    assert (s["num_running_reqs"], s["num_waiting_reqs"]) == (2, 3)
    ((load,),) = [legacy_loads(s)]
    assert load["dp_rank"] == 0 and load["num_reqs"] == 5 and load["num_waiting_reqs"] == 3
    waiting_prompts = 22 + 23 + 24  # (seeds 2-4 wait: the first two run)
    assert load["num_pending_tokens"] == waiting_prompts
    assert load["num_tokens"] == s["num_used_tokens"] + waiting_prompts and s["num_used_tokens"] >= 20 + 21
    (core,), aggregate = v1_loads(s, None, None)
    assert core["num_total_reqs"] == 5 and core["utilization"] == 1.0
    assert core["memory"]["num_used_mamba_slots"] >= 2 and core["queues"]["pending_tokens"] == waiting_prompts
    assert aggregate["total_reqs"] == 5 and aggregate["total_used_tokens"] == s["num_used_tokens"]


def test_two_replicas_each_get_their_load(busy_state):
    idle = dict(busy_state, num_running_reqs=0, num_waiting_reqs=0, num_waiting_tokens=0, num_used_tokens=0)
    merged = merge_replies([GetInternalStateReqOutput(busy_state), GetInternalStateReqOutput(idle)]).internal_state
    loads = legacy_loads(merged)
    assert [(x["dp_rank"], x["num_reqs"]) for x in loads] == [(0, 5), (1, 0)] and loads[1]["num_tokens"] == 0
    (second,), aggregate = v1_loads(merged, 1, "core")
    assert second["dp_rank"] == 1 and "memory" not in second and aggregate["total_reqs"] == 0


def test_the_routes_answer_and_refuse_bad_parameters(busy_state):
    async def state(timeout: float = 0):
        return busy_state

    async def get(app, path):
        return await asgi_request(app, "GET", path)

    with served_app() as (app, tm):
        tm.get_internal_state = state
        status, body = asyncio.run(get(app, "/get_load"))
        assert status == 200 and orjson.loads(body)[0]["num_reqs"] == 5
        status, body = asyncio.run(get(app, "/v1/loads"))
        reply = orjson.loads(body)
        assert status == 200 and reply["dp_rank_count"] == 1 and reply["aggregate"]["total_waiting_reqs"] == 3
        for path, param in (("/v1/loads?dp_rank=3", "dp_rank"), ("/v1/loads?dp_rank=x", "dp_rank"),
                            ("/v1/loads?dp_rank=%C2%B2", "dp_rank"), ("/v1/loads?dp_rank=" + "1" * 5000, "dp_rank"),
                            ("/v1/loads?include=gpu", "include"), ("/v1/loads?format=xml", "format")):  # fmt: skip
            status, body = asyncio.run(get(app, path))
            assert status == 400 and orjson.loads(body)["error"]["param"] == param, (path, body)
