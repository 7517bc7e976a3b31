"""The scheduler's side of /update_weights_from_disk (`WeightUpdate`, `Scheduler.finish_weight_update`,
`ModelRunner.load_like_current` / `swap_model`): the checkpoint loads on a thread while the loop goes on,
then the model is swapped between two steps and the prefix cache emptied. Outputs match the new
checkpoint's oracle, through the graph runner's bodies too (and on CUDA through graphs captured again);
a failed or a second concurrent update leaves the old weights serving."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.managers.io_struct import (
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightFromDiskReqOutput,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import noisy_checkpoint, pool_state
from sglang.test.reference import ReferenceModel
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=15, suite="per-commit-cpu")

QWEN, NEMOTRON = "tiny-qwen3-next", "tiny-nemotron-h"
# float32 on CUDA: as the other GPU oracle checks (test_strategy_matrix.GPU_ORACLE_TOL says why).
GPU_TOL = 1e-3


def send_update(h: SchedulerHarness, path: str, **fields) -> None:
    h.sched.process_input_requests([UpdateWeightFromDiskReqInput(path, **fields)])


def wait_reply(h: SchedulerHarness) -> UpdateWeightFromDiskReqOutput:
    """What the scheduler's loop does while an update loads: poll it each iteration."""
    return h.control_reply()


@pytest.fixture(scope="module")
def checkpoint_b(preset_paths, tmp_path_factory):
    path = noisy_checkpoint(preset_paths[QWEN], tmp_path_factory.mktemp("weights") / "b")
    return path, ReferenceModel(path)


def test_the_swap_serves_the_new_weights_through_the_graph_bodies(oracles, checkpoint_b, preset_paths):
    path_b, oracle_b = checkpoint_b
    h = SchedulerHarness(QWEN)
    runner = h.sched.model_runner
    h.use_graph_bodies([1, 2, 4])
    prompts = [token_ids(70 + 11 * k, seed=k) for k in range(3)]
    for p in prompts:
        h.check_oracle(oracles[QWEN], p, h.generate(p, 6))
    captured = dict(runner.graph_runner.decode.outputs)
    send_update(h, path_b)
    reply = wait_reply(h)
    assert (reply.success, reply.num_paused_requests) == (True, 0), reply.message
    recaptured = runner.graph_runner.decode.outputs
    assert set(recaptured) == set(captured) and all(recaptured[b] is not captured[b] for b in captured)
    rids = [h.submit(p, 6) for p in prompts]
    h.run()
    for p, rid in zip(prompts, rids, strict=True):
        out = h.outputs[rid]
        assert out.cached_tokens == 0  # the old weights' prefixes are gone
        h.check_oracle(oracle_b, p, out)
    h.sched.check_integrity()
    h.shutdown()


def test_a_failed_or_second_update_keeps_the_weights_serving(oracles, checkpoint_b, preset_paths):
    path_b, _ = checkpoint_b
    h = SchedulerHarness(QWEN)
    model = h.sched.model_runner.model
    send_update(h, preset_paths[NEMOTRON])
    reply = wait_reply(h)
    assert not reply.success and "its architecture is 'NemotronHForCausalLM'" in reply.message
    send_update(h, path_b)
    send_update(h, path_b)  # while the first loads
    refused = h.sched.tokenizer_outbox.pop()
    assert not refused.success and "still loading" in refused.message
    assert wait_reply(h).success
    send_update(h, preset_paths[QWEN])  # back
    assert wait_reply(h).success and h.sched.model_runner.model is not model
    prompt = token_ids(50, seed=5)
    h.check_oracle(oracles[QWEN], prompt, h.generate(prompt, 6))
    h.shutdown()


def test_capturing_again_leaves_a_running_requests_state_alone():
    """A swap with flush_cache false while a request runs (paused in place): the graphs are captured
    again on the dummy rows, not on what the last replay left in the static buffers (that request's
    row and slots), which would advance its state."""
    h = SchedulerHarness(QWEN)
    runner = h.sched.model_runner
    h.use_graph_bodies([1, 2, 4])
    rid = h.submit(token_ids(30, seed=4), max_new_tokens=50)
    for _ in range(6):  # its prefill, then decodes replayed through the graph runner's bodies
        h.sched.step()
    while h.sched.in_flight:
        h.sched.process_oldest()
    req = h.sched.reqs_by_rid[rid]
    assert len(req.output_ids) >= 3 and req in h.sched.running
    before = pool_state(runner, req.mamba_pool_idx)
    runner.graph_runner.recapture()
    after = pool_state(runner, req.mamba_pool_idx)
    assert all(torch.equal(before[k].ssm, after[k].ssm) and torch.equal(before[k].conv, after[k].conv) for k in before)
    h.run()
    h.check_oracle(ReferenceModel(QWEN), token_ids(30, seed=4), h.outputs[rid])
    h.shutdown()


def test_a_disk_update_is_refused_while_memory_is_released(checkpoint_b):
    """A second model would load into memory the trainer holds, and its graphs be captured on freed
    pools: refused at once until everything is resumed. Tags None is all of them, as upstream's clients
    send it."""
    path_b, _ = checkpoint_b
    h = SchedulerHarness(QWEN, enable_memory_saver=True)
    reply = h.control_reply(ReleaseMemoryOccupationReqInput(None))
    assert reply.success and reply.released == ["cuda_graph", "kv_cache", "weights"], reply
    reply = h.control_reply(ResumeMemoryOccupationReqInput(["weights"]))
    assert reply.released == ["cuda_graph", "kv_cache"]
    send_update(h, path_b)
    reply = wait_reply(h)
    assert not reply.success and "memory is released" in reply.message
    reply = h.control_reply(ResumeMemoryOccupationReqInput(None))
    assert reply.success and reply.released == []
    send_update(h, path_b)
    assert wait_reply(h).success
    h.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graphs_are_captured_again_with_the_new_weights(oracles, checkpoint_b):
    """The graphs hold the old weights' addresses: replays after the swap must run the new ones."""
    path_b, oracle_b = checkpoint_b
    h = SchedulerHarness(QWEN, device="cuda", dtype="float32")
    assert h.sched.model_runner.graph_runner.use_graphs
    prompts = [token_ids(40 + 9 * k, seed=k) for k in range(3)]
    for p in prompts:
        h.check_oracle(oracles[QWEN], p, h.generate(p, 8), tol=GPU_TOL)
    send_update(h, path_b)
    assert wait_reply(h).success
    rids = [h.submit(p, 8) for p in prompts]
    h.run()
    for p, rid in zip(prompts, rids, strict=True):
        h.check_oracle(oracle_b, p, h.outputs[rid], tol=GPU_TOL)
    h.shutdown()
