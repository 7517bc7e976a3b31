"""Deferred clear / copy of mamba slots run in `init_forward_metadata` of an extend (clear first, then
copy), before any layer reads the slots; SGLANG_TEST_SKIP_DEFERRED_COW switches the copy off, and a
request that resumes from a checkpoint is then wrong (the negative control of the resume test)."""

from __future__ import annotations

import torch

from sglang.srt.environ import envs
from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, max_abs, random_ids
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=5, suite="per-commit-cpu")


def _fill(pool, slot: int, value: float) -> None:
    pool.conv_state[:, slot] = value
    pool.ssm_state[:, slot] = torch.randn_like(pool.ssm_state[:, slot]) + value


def _run_extend_with_deferred_ops(driver: RunnerDriver, clear: list[int], src: list[int], dst: list[int]):
    req = driver.new_request()
    req.mamba_needs_clear = False
    fb = ForwardBatch.create(
        ForwardMode.EXTEND,
        input_ids=random_ids(5, seed=50),
        req_pool_indices=[req.req_pool_idx],
        seq_lens=[5],
        out_cache_loc=driver.kv_allocator.alloc_extend(0, 5, 0),
        mamba_pool_indices=[req.mamba_pool_idx],
        extend_prefix_lens=[0],
        mamba_clear_indices=clear,
        mamba_cow_src_indices=src,
        mamba_cow_dst_indices=dst,
    )
    driver.runner.forward_batch_generation(fb)
    return fb


def test_clear_then_copy_runs_before_the_forward():
    driver = RunnerDriver(make_runner("tiny-nemotron-h"))
    pool = driver.runner.mamba_pool
    cleared, src, dst, both = driver.alloc_mamba_slots(4)
    for slot, value in [(cleared, 3.0), (src, 5.0), (dst, 7.0), (both, 9.0)]:
        _fill(pool, slot, value)
    src_conv, src_ssm = pool.conv_state[:, src].clone(), pool.ssm_state[:, src].clone()

    fb = _run_extend_with_deferred_ops(driver, [cleared, both], [src, src], [dst, both])
    assert pool.conv_state[:, cleared].abs().max() == 0 and pool.ssm_state[:, cleared].abs().max() == 0
    for slot in (dst, both):  # `both` was cleared and then received the copy
        assert torch.equal(pool.conv_state[:, slot], src_conv) and torch.equal(
            pool.ssm_state[:, slot], src_ssm
        )
    assert (
        fb.mamba_clear_indices is None
        and fb.mamba_cow_src_indices is None
        and fb.mamba_cow_dst_indices is None
    )


def test_skip_deferred_cow_switch_leaves_the_destination_and_still_clears():
    driver = RunnerDriver(make_runner("tiny-nemotron-h"))
    pool = driver.runner.mamba_pool
    cleared, src, dst = driver.alloc_mamba_slots(3)
    for slot, value in [(cleared, 3.0), (src, 5.0), (dst, 7.0)]:
        _fill(pool, slot, value)
    before = pool.ssm_state[:, dst].clone()
    with envs.SGLANG_TEST_SKIP_DEFERRED_COW.override(True):
        _run_extend_with_deferred_ops(driver, [cleared], [src], [dst])
    assert torch.equal(pool.ssm_state[:, dst], before)
    assert pool.ssm_state[:, cleared].abs().max() == 0


def test_resume_from_checkpoint_needs_the_copy(oracles):
    preset = "tiny-qwen3-next"
    prompt = random_ids(200, seed=51)
    expected = oracles[preset].token_logprobs(prompt, start=129)
    errors = {}
    for skip in (False, True):
        driver = RunnerDriver(make_runner(preset))
        donor = driver.new_request()
        # The default strategy (extra_buffer_lazy) keeps no track slot: the checkpoint is a slot
        # borrowed from the pool, as the scheduler's tracker takes one.
        [checkpoint] = driver.alloc_mamba_slots(1)
        driver.extend([Extend(donor, prompt[:128], track_seqlen=128, track_slot=checkpoint)])
        fresh = driver.new_request()
        with envs.SGLANG_TEST_SKIP_DEFERRED_COW.override(skip):
            res = driver.extend([Extend(fresh, prompt[128:], prefix_from=(donor, 128), cow_src=checkpoint)])
        errors[skip] = max_abs(res.input_token_logprobs[0], expected)
    assert errors[False] < 1e-4
    # Without the copy the request starts from a cleared slot: measured error ~3.
    assert errors[True] > 0.5
