"""The scheduler's side of /update_weights_from_tensor (`Scheduler.update_weights_from_tensor`): the
payload unpickles through `MultiprocessingSerializer`'s allowlist, the tensors are written into the
weights in place between two steps, and the prefix cache is emptied. Outputs then match the new
checkpoint's oracle, through the graph runner's bodies too (and on CUDA through the graphs captured at
start: the parameters keep their memory). A refused update (requests holding state, a payload that is
not tensors, a tensor that does not fit) leaves the old weights serving."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput, UpdateWeightsFromTensorReqOutput
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket, FlattenedTensorMetadata
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import noisy_checkpoint, served_tensors
from sglang.test.reference import ReferenceModel
from sglang.test.scheduler_harness import SchedulerHarness, token_ids

register_cpu_ci(est_time=10, suite="per-commit-cpu")

QWEN = "tiny-qwen3-next"
GPU_TOL = 1e-3  # float32 on CUDA, as test_update_weights.GPU_TOL


@pytest.fixture(scope="module")
def checkpoint_b(preset_paths, tmp_path_factory):
    path = noisy_checkpoint(preset_paths[QWEN], tmp_path_factory.mktemp("weights") / "b")
    return served_tensors(path), ReferenceModel(path)


def update(h: SchedulerHarness, payload: bytes | str, **fields) -> UpdateWeightsFromTensorReqOutput:
    return h.control_reply(UpdateWeightsFromTensorReqInput([payload], **fields))


def test_an_update_serves_the_new_weights_through_the_graph_bodies(oracles, checkpoint_b):
    tensors, oracle_b = checkpoint_b
    h = SchedulerHarness(QWEN)
    runner = h.sched.model_runner
    h.use_graph_bodies([1, 2, 4])
    prompts = [token_ids(70 + 11 * k, seed=k) for k in range(3)]
    for p in prompts:
        h.check_oracle(oracles[QWEN], p, h.generate(p, 6))
    captured = dict(runner.graph_runner.decode.outputs)
    names = sorted(tensors)
    # Three updates (a trainer sends its weights in buckets): by handle; by value, as an HTTP client
    # would; one FlattenedTensorBucket (upstream's flattened_bucket format).
    first = update(h, MultiprocessingSerializer.serialize([(n, tensors[n]) for n in names[::3]]))
    assert first.success, first.message
    second = update(h, pickle.dumps([(n, tensors[n]) for n in names[1::3]]), trusted=False)
    message = f"Succeeded to update {len(names[1::3])} weight tensor(s) in place."
    assert (second.success, second.message) == (True, message)
    bucket = FlattenedTensorBucket(named_tensors=[(n, tensors[n]) for n in names[2::3]])
    flat = {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()}
    third = update(h, MultiprocessingSerializer.serialize(flat, True), load_format="flattened_bucket")
    assert third.success, third.message
    assert runner.graph_runner.decode.outputs == captured  # nothing captured again: same memory
    rids = [h.submit(p, 6) for p in prompts]
    h.run()
    for p, rid in zip(prompts, rids, strict=True):
        assert h.outputs[rid].cached_tokens == 0  # the old weights' prefixes are gone
        h.check_oracle(oracle_b, p, h.outputs[rid])
    h.sched.check_integrity()
    h.shutdown()


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_refused_updates_keep_the_old_weights_serving(oracles, checkpoint_b):
    tensors, _ = checkpoint_b
    h = SchedulerHarness(QWEN)
    good = list(tensors.items())
    bad_shape = [*good, ("model.norm.weight", torch.zeros(3))]
    for payload, trusted, words in [
        (pickle.dumps([("model.norm.weight", _Evil())]), True, "names posix.system"),
        (MultiprocessingSerializer.serialize(good), False, "shared memory of the sender"),
        (pickle.dumps({"model.norm.weight": torch.zeros(3)}), True, "not a list of (name, tensor) pairs"),
        (pickle.dumps([("model.norm.weight", [1.0])]), True, "item 0 of the payload"),
        (pickle.dumps(bad_shape), True, "model.norm.weight has shape (3,)"),
        ("not base64!", False, "not valid base64"),
    ]:
        reply = update(h, payload, trusted=trusted)
        assert not reply.success and words in reply.message, reply.message
    for payload, words in [
        (pickle.dumps(good), '{"flattened_tensor": ..., "metadata": [...]}'),
        (pickle.dumps({"flattened_tensor": torch.zeros(4, dtype=torch.uint8), "metadata": [
            FlattenedTensorMetadata("model.norm.weight", torch.Size([16]), torch.float32, 0, 64, 16)]}),
         "does not match bytes [0, 64) of a 4-byte tensor"),
    ]:  # fmt: skip
        reply = update(h, payload, load_format="flattened_bucket")
        assert not reply.success and words in reply.message, reply.message
    # A request running with its state: a flushing update would strand it.
    rid = h.submit(token_ids(30, seed=4), max_new_tokens=30)
    h.sched.step()
    reply = update(h, pickle.dumps(good))
    assert not reply.success and "hold KV and state" in reply.message
    h.run()
    h.check_oracle(oracles[QWEN], token_ids(30, seed=4), h.outputs[rid])
    prompt = token_ids(50, seed=5)
    h.check_oracle(oracles[QWEN], prompt, h.generate(prompt, 6))
    h.shutdown()


def test_a_tensor_that_fails_in_a_models_mapping_is_refused_not_a_crash(oracles):
    """Granite splits its shared MLP's input rows: a 0-d tensor there fails in torch (RuntimeError), and
    the scheduler answers with why instead of dying."""
    h = SchedulerHarness("tiny-granite-4.0-h")
    reply = update(h, pickle.dumps([("model.layers.0.shared_mlp.input_linear.weight", torch.tensor(1.0))]))
    assert not reply.success and "chunk expects" in reply.message, reply.message
    prompt = token_ids(30, seed=8)
    h.check_oracle(oracles["tiny-granite-4.0-h"], prompt, h.generate(prompt, 6))
    h.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_graph_replays_read_the_weights_written_in_place(oracles, checkpoint_b):
    """Tensors written into the parameters the captured graphs read: replays compute with them. (Host
    tensors: a CUDA tensor's IPC handle cannot be opened by the process that made it.)"""
    tensors, oracle_b = checkpoint_b
    h = SchedulerHarness(QWEN, device="cuda", dtype="float32")
    assert h.sched.model_runner.graph_runner.use_graphs
    prompts = [token_ids(40 + 9 * k, seed=k) for k in range(3)]
    for p in prompts:
        h.check_oracle(oracles[QWEN], p, h.generate(p, 8), tol=GPU_TOL)
    reply = update(h, MultiprocessingSerializer.serialize(list(tensors.items())))
    assert reply.success, reply.message
    rids = [h.submit(p, 8) for p in prompts]
    h.run()
    for p, rid in zip(prompts, rids, strict=True):
        h.check_oracle(oracle_b, p, h.outputs[rid], tol=GPU_TOL)
    h.shutdown()
