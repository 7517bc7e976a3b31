"""PD disaggregation on one CUDA GPU (skipped without one): a prefill and a decode server on the same GPU
(fixed pools: a few MB each) behind the router, under every mamba strategy, with the decode radix cache,
through the staged path (pinned host buffers, disaggregation/staging.py) and, where Mooncake's CUDA
build is installed, the direct one. Answers equal a single server's (the prefill server asked without
bootstrap fields), a conversation's next turns move only the new tokens' KV and one state, and a
transfer that fails ends only its own request while its neighbours finish.

    .venv/bin/python -m pytest -q test/registered/disaggregation/test_pd_gpu.py
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang.srt.disaggregation.staging import mooncake_moves_gpu_memory
from sglang.test.ci_register import register_cpu_ci
from sglang.test.pd_conversation import assert_same_generation, conversation_turns, generate_body, post
from sglang.test.router_process import start_pd, stop_all

register_cpu_ci(est_time=5, suite="nightly-cpu")  # skipped on CPU machines

FAIL_PREFIX = "fail-transfer-"
# Fixed pools on both servers: with a size flag missing, each server's budget is SGLang's (free memory at
# its start minus (1 - fraction) x total), so the second server to measure sees the first one's pools
# taken and its budget negative ("leaves no memory for the caches"). With both sizes given nothing is
# measured (`pool_sizing.compute_pool_sizes`); 65,536 tokens and 64 slots of the tiny preset take a few MB.
GPU = ["--device", "cuda", "--max-total-tokens", "65536", "--max-mamba-cache-size", "64"]
PATHS = ["staged"] + (["direct"] if mooncake_moves_gpu_memory() else [])
STRATEGIES = ["no_buffer", "extra_buffer", "extra_buffer_lazy"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_pd_pair_on_one_gpu(strategy, path, preset_paths):
    env = {
        "SGLANG_DISAGGREGATION_SECRET": "pd-gpu-test",
        "SGLANG_DISAGGREGATION_STAGING": str(int(path == "staged")),
    }
    strat = ["--mamba-scheduler-strategy", strategy]
    prefill, decode, router, _ = start_pd(
        preset_paths["tiny-qwen3-next"],
        [*GPU, *strat],
        [*GPU, *strat, "--disaggregation-decode-enable-radix-cache"],
        {**env, "SGLANG_TEST_DISAGGREGATION_FAIL_TRANSFER": FAIL_PREFIX},
        env,
    )
    try:
        pd = {"prefill": prefill, "decode": decode, "router": router}
        assert ("through a" in decode.log_text()) == (path == "staged")
        first = [(5 * j + 1) % 400 + 3 for j in range(41)]
        new = [[(3 * j + 7 + 50 * t) % 400 + 3 for j in range(8)] for t in range(2)]
        assert conversation_turns(pd, first, new) == [41, 9, 9]
        # A failed transfer among concurrent requests: only its own request fails.
        ids = [[(7 * i + j) % 400 + 3 for j in range(30 + i)] for i in range(6)]
        wants = [post(prefill.base_url + "/generate", generate_body(p)).json() for p in ids]
        bodies = [
            generate_body(p, rid=(FAIL_PREFIX if i == 2 else "ok-") + str(i)) for i, p in enumerate(ids)
        ]
        with ThreadPoolExecutor(6) as pool:
            replies = list(pool.map(lambda b: post(router.base_url + "/generate", b), bodies))
        for i, (r, want) in enumerate(zip(replies, wants, strict=True)):
            if i == 2:
                assert r.status_code == 500
            else:
                assert r.status_code == 200, r.text
                assert_same_generation(r.json(), want)
    finally:
        stop_all(prefill, decode, router)
