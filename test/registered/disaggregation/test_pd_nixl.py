"""A PD pair on `--disaggregation-transfer-backend nixl` behind the router: Nemotron-H's CPU pools
registered with NIXL as they are, and Qwen3-Next's through the staging buffers in chunks (a 20 KB
chunk, as test_pd_router.py's staged pair). Answers equal the prefill server's own (asked without
bootstrap fields), a failed transfer fails only its request, and nothing is held afterwards. Runs where
NIXL imports (`pip install 'sglang[nixl]'`); skipped elsewhere. Nightly (a pair per preset, ~20 s each
to start):

    .venv/bin/python -m pytest -q test/registered/disaggregation/test_pd_nixl.py
"""

from __future__ import annotations

import time

import pytest

from sglang.srt.disaggregation.nixl_backend import nixl_module
from sglang.test.ci_register import register_cpu_ci
from sglang.test.pd_conversation import assert_same_generation, generate_body, internal_state, post
from sglang.test.router_process import start_pd, stop_all

register_cpu_ci(est_time=160, suite="nightly-cpu")

pytestmark = pytest.mark.skipif(
    nixl_module() is None, reason="NIXL is not installed (pip install 'sglang[nixl]', nixl-cu12)"
)

SECRET = "pd-nixl-test-secret"
FAIL_PREFIX = "fail-transfer-"
STAGED = {
    "SGLANG_DISAGGREGATION_STAGING": "1",
    "SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": "0.02",
    "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "0.05",
}
CASES = {"tiny-nemotron-h": {}, "tiny-qwen3-next": STAGED}


@pytest.mark.parametrize("preset", list(CASES))
def test_a_pair_on_nixl_answers_as_one_server(preset, preset_paths):
    env = {"SGLANG_DISAGGREGATION_SECRET": SECRET, **CASES[preset]}
    backend = ["--disaggregation-transfer-backend", "nixl"]
    prefill, decode, router, _ = start_pd(
        preset_paths[preset], backend, backend,
        {**env, "SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER": FAIL_PREFIX}, env,
    )  # fmt: skip
    try:
        for n in (5, 17, 129, 300):  # across pages and, staged, 1 to 5 chunks
            ids = [(7 * n + 3 * j) % 500 + 3 for j in range(n)]
            want = post(prefill.base_url + "/generate", generate_body(ids)).json()
            r = post(router.base_url + "/generate", generate_body(ids))
            assert r.status_code == 200, r.text
            assert_same_generation(r.json(), want)
        failed = post(router.base_url + "/generate", generate_body([5, 6, 7], rid=FAIL_PREFIX + "1"))
        assert failed.status_code == 500, failed.text
        state = internal_state(decode)["disaggregation"]
        assert state["transfers"] == 4 and state["failed_transfers"] >= 1 and state["bytes"] > 0
        if CASES[preset]:
            assert state["staged_chunks"] == 1 + 2 + 3 + 5, state
        deadline = time.monotonic() + 15
        while True:  # nothing held by requests on either side
            held = [
                (s["token_usage"]["held_by_requests"], s["mamba_usage"]["held_by_requests"],
                 s["disaggregation"].get("staging_ranges", 0))
                for s in (internal_state(prefill), internal_state(decode))
            ]  # fmt: skip
            if held == [(0, 0, 0), (0, 0, 0)]:
                break
            assert time.monotonic() < deadline, held
            time.sleep(0.2)
    finally:
        stop_all(router, decode, prefill)
