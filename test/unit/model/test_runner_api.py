"""ModelRunner contract details: logprob start and top logprobs of input tokens, a forward on a worker
thread (inference mode is thread-local), an idle batch, and pools built from ServerArgs."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, max_abs, prefill, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=7, suite="per-commit-cpu")

TOL = 1e-4  # float32 against the float32 oracle, as in test_logprobs_vs_oracle


def test_logprob_start_and_top_logprobs_of_input_tokens(oracles):
    preset = "tiny-nemotron-h"
    driver = RunnerDriver(make_runner(preset))
    prompt = random_ids(60, seed=80)
    req = driver.new_request()
    driver.extend([Extend(req, prompt[:20])])
    res = driver.extend(
        [Extend(req, prompt[20:50], logprob_start=5, next_token=prompt[50])], top_logprobs_num=3
    )
    # Tokens at extend offsets 6..29, then the next chunk's first token: absolute positions 26..50.
    want = oracles[preset].logprobs(prompt)
    got = res.input_token_logprobs[0]
    assert max_abs(got, want[25:50].gather(1, torch.tensor(prompt[26:51])[:, None])[:, 0]) < TOL
    tops = res.input_top_logprobs[0]
    assert len(tops) == len(got) == 25
    values, ids = tops[0]
    ref_values, ref_ids = want[25].topk(3)
    assert ids == ref_ids.tolist() and max_abs(values, ref_values) < TOL


def test_forward_on_a_worker_thread_equals_the_calling_thread():
    prompt = random_ids(70, seed=81)
    driver = RunnerDriver(make_runner("tiny-qwen3-next"))
    on_main = prefill(driver, driver.new_request(), prompt)
    worker_driver = RunnerDriver(make_runner("tiny-qwen3-next"))
    with ThreadPoolExecutor(1) as pool:
        on_worker = pool.submit(lambda: prefill(worker_driver, worker_driver.new_request(), prompt)).result()
    assert on_worker == on_main
    assert not torch.is_inference_mode_enabled()


def test_idle_batch_and_pools_from_server_args():
    runner = make_runner("tiny-qwen3-next", page_size=16, max_total_tokens=4096, max_mamba_cache_size=20)
    assert runner.forward_batch_generation(ForwardBatch.idle()).next_token_ids.numel() == 0
    assert runner.req_to_token_pool.mamba_pool.size == 20 and runner.token_to_kv_pool.page_size == 16
    # `auto` with overlap and the radix cache on is extra_buffer_lazy: one resident track slot.
    assert runner.req_to_token_pool.strategy.lazy
    # Three GDN layers; conv (2 * 2 * 16 + 4 * 16, K - 1), SSM (4 value heads, 16, 16), float32.
    assert runner.mamba_pool.conv_state.shape == (3, 21, 128, 3)
    assert runner.mamba_pool.ssm_state.shape == (3, 21, 4, 16, 16)
    assert runner.mamba_pool.ssm_state.dtype == torch.float32


def test_driver_frees_every_slot_of_an_extra_buffer_request():
    # RunnerDriver.free goes through HybridReqToTokenPool.free_mamba_cache, which reads the request's
    # borrowed-snapshot list; a driver request without that field crashed there.
    runner = make_runner("tiny-qwen3-next", mamba_scheduler_strategy="extra_buffer")
    driver = RunnerDriver(runner)
    allocator = runner.req_to_token_pool.mamba_allocator
    free_before = allocator.available_size()
    req = driver.new_request()
    driver.extend([Extend(req, random_ids(40, seed=82))])
    assert allocator.available_size() < free_before
    driver.free(req)
    assert allocator.available_size() == free_before
