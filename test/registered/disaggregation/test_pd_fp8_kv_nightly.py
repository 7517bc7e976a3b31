"""A PD pair with a float8 KV cache (`--kv-cache-dtype fp8_e4m3` on both servers) behind the router,
Qwen3-Next's pools moved through the staging buffers in chunks (disaggregation/staging.py on CPU
tensors, the path of CUDA pools with a host-only transfer engine): its answers equal the prefill
server's own (asked without bootstrap fields: a single server with the same float8 KV), tokens and
logprobs. Before the fix the decode server's unpack raised NotImplementedError (torch has no float8
`index_copy_`): no request got an answer (a 60 s read timeout). Nightly (one PD pair, ~15 s to start):

    .venv/bin/python -m pytest -q test/registered/disaggregation/test_pd_fp8_kv_nightly.py
"""

from __future__ import annotations

import requests

from sglang.test.ci_register import register_cpu_ci
from sglang.test.pd_conversation import assert_same_generation, generate_body, internal_state, post
from sglang.test.router_process import start_pd, stop_all

register_cpu_ci(est_time=45, suite="nightly-cpu")

SECRET = "pd-fp8-kv-test-secret"
# A 20 KB staging chunk (test_pd_router.py's): a prompt of 16 positions or more moves in several chunks.
STAGED = {
    "SGLANG_DISAGGREGATION_SECRET": SECRET,
    "SGLANG_DISAGGREGATION_STAGING": "1",
    "SGLANG_DISAGG_STAGING_BUFFER_SIZE_MB": "0.02",
    "SGLANG_DISAGG_STAGING_POOL_SIZE_MB": "0.05",
}
FP8 = ["--kv-cache-dtype", "fp8_e4m3"]


def test_a_staged_pair_with_float8_kv_answers_as_one_server(preset_paths):
    prefill, decode, router, _ = start_pd(preset_paths["tiny-qwen3-next"], FP8, FP8, STAGED, STAGED)
    try:
        for server in (prefill, decode):
            info = requests.get(server.base_url + "/get_server_info", timeout=10).json()
            assert info["kv_cache_dtype"] == "fp8_e4m3"
        lengths = (5, 17, 129, 300)  # across pages, 1 to several chunks
        for n in lengths:
            ids = [(7 * n + 3 * j) % 500 + 3 for j in range(n)]
            want = post(prefill.base_url + "/generate", generate_body(ids)).json()
            r = post(router.base_url + "/generate", generate_body(ids))
            assert r.status_code == 200, r.text
            assert_same_generation(r.json(), want)
        state = internal_state(decode)["disaggregation"]
        assert state["transfers"] == len(lengths) and state["failed_transfers"] == 0, state
        assert state["staged_chunks"] > len(lengths), state  # (the long prompts in several chunks)
    finally:
        stop_all(router, decode, prefill)
