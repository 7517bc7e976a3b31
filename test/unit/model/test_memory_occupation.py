"""`MemoryOccupation` (/release_memory_occupation, /resume_memory_occupation): releasing a tag empties
the storages of its tensors (the weights, every pool's buffers, the graphs) and resuming gives them back;
the model then computes exactly what it did, with the weights written again by an update (an RL loop's
order: resume the weights, update them, resume the cache) or put back from the host copy."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner
from sglang.srt.model_executor.memory_occupation import TAGS
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import decode_steps, make_runner, prefill, random_ids, served_tensors
from sglang.test.runner_driver import RunnerDriver

register_cpu_ci(est_time=6, suite="per-commit-cpu")


def run(runner, prompt: list[int]) -> list[float]:
    """A prefill, then decode steps (through the graph runner's bodies where it has one)."""
    driver = RunnerDriver(runner)
    req = driver.new_request()
    lps = prefill(driver, req, prompt)
    return lps + decode_steps(driver, [req], 4)[0]


def memory_bytes(runner) -> dict[str, int]:
    pools = (runner.req_to_token_pool.req_to_token, runner.mamba_pool.conv_state, runner.mamba_pool.ssm_state,
             *runner.token_to_kv_pool.k_buffer, *runner.token_to_kv_pool.v_buffer)  # fmt: skip
    return {"weights": storage_bytes(runner.model.parameters()), "kv_cache": storage_bytes(pools)}


def storage_bytes(tensors) -> int:
    """The bytes of the storages behind `tensors`, each storage once: stacked linears' weights
    (`stack_linear_weights`) and tied ones are views of one storage, released once."""
    return sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in tensors}.values())


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_released_and_resumed_with_the_weights_written_again(preset, preset_paths):
    prompt = random_ids(40, seed=9)
    runner = make_runner(preset)
    runner.graph_runner = CudaGraphRunner(runner, [1, 2], use_graphs=False)
    before = run(runner, prompt)
    held = memory_bytes(runner)
    runner.memory_occupation.release(list(TAGS))
    assert memory_bytes(runner) == {"weights": 0, "kv_cache": 0}
    assert runner.graph_runner.decode.outputs == {}
    runner.memory_occupation.resume(["weights"])
    assert memory_bytes(runner)["weights"] == held["weights"]
    tensors = served_tensors(preset_paths[preset])
    assert runner.update_weights_from_tensor(list(tensors.items())) == []
    assert runner.graph_runner.decode.outputs == {}  # not captured while the cache is released
    runner.memory_occupation.resume(["kv_cache"])
    assert memory_bytes(runner) == held
    pool = runner.mamba_pool
    assert not pool.conv_state.any() and not pool.ssm_state.any()  # zeroed, as made
    assert runner.graph_runner.decode.outputs == {}
    runner.memory_occupation.resume(["cuda_graph"])
    assert runner.graph_runner.decode.outputs  # captured again, now that nothing is released
    assert run(runner, prompt) == before  # bit for bit


def test_the_host_copy_brings_the_weights_back():
    prompt = random_ids(40, seed=10)
    runner = make_runner("tiny-qwen3-next", enable_weights_cpu_backup=True)
    before = run(runner, prompt)
    runner.memory_occupation.release(["weights"])
    assert memory_bytes(runner)["weights"] == 0
    runner.memory_occupation.release(["weights"])  # again: nothing more to do
    runner.memory_occupation.resume(["weights", "weights"])
    assert run(runner, prompt) == before
    assert runner.memory_occupation.released == set()


def test_state_copies_reach_the_resumed_pools():
    """The state copier's tables hold raw addresses: after the pools come back elsewhere, a slot copy
    must land in them (with the old tables it wrote to freed memory and left the pool as it was)."""
    runner = make_runner("tiny-nemotron-h")
    pool = runner.mamba_pool
    runner.memory_occupation.release(["kv_cache"])
    runner.memory_occupation.resume(["kv_cache"])
    pool.conv_state[:, 1].fill_(3.0)
    pool.ssm_state[:, 1].fill_(4.0)
    pool.copy_from([1], [2])
    assert (pool.conv_state[:, 2] == 3.0).all() and (pool.ssm_state[:, 2] == 4.0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_memory_goes_back_to_the_driver_and_graphs_replay_after_resume(preset_paths):
    """On CUDA: released memory leaves the allocator (what a trainer on the GPU gets), and decode
    replays graphs captured again on the resumed memory, computing what they did."""
    prompt = random_ids(40, seed=12)
    runner = make_runner("tiny-qwen3-next", device="cuda", dtype="float32")
    assert runner.graph_runner is not None and runner.graph_runner.use_graphs
    before = run(runner, prompt)
    held = sum(memory_bytes(runner).values())
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    runner.memory_occupation.release(list(TAGS))
    assert allocated - torch.cuda.memory_allocated() >= held
    # Segments go back to the driver where nothing else lives in them: the tiny preset's small tensors
    # share 2 MB segments with others (measured on an H200: 4 of its 6.7 MB came back), a large model's
    # weights and pools have segments of their own.
    assert torch.cuda.memory_reserved() < reserved
    runner.memory_occupation.resume(["weights"])
    tensors = served_tensors(preset_paths["tiny-qwen3-next"])
    runner.update_weights_from_tensor(list(tensors.items()))
    runner.memory_occupation.resume(["kv_cache", "cuda_graph"])
    assert runner.graph_runner.decode.graphs
    # The same kernels on the same values; a kernel that accumulates with atomics may round otherwise,
    # far below 1e-4 in a float32 logprob.
    assert max(abs(a - b) for a, b in zip(run(runner, prompt), before, strict=True)) < 1e-4


def test_a_resume_that_runs_out_of_memory_leaves_the_tag_released(monkeypatch):
    """All or none: the storages given back before the failure are emptied again, and a later resume
    works."""
    runner = make_runner("tiny-nemotron-h")
    runner.memory_occupation.release(["kv_cache"])
    real, calls = torch.UntypedStorage.resize_, []

    def resize(storage, nbytes):
        calls.append(nbytes)
        if nbytes and len([n for n in calls if n]) == 3:
            raise RuntimeError("out of memory")
        return real(storage, nbytes)

    monkeypatch.setattr(torch.UntypedStorage, "resize_", resize)
    with pytest.raises(RuntimeError, match="out of memory"):
        runner.memory_occupation.resume(["kv_cache"])
    monkeypatch.undo()
    assert runner.memory_occupation.released == {"kv_cache"} and memory_bytes(runner)["kv_cache"] == 0
    runner.memory_occupation.resume(["kv_cache"])
    assert memory_bytes(runner)["kv_cache"] > 0 and not runner.memory_occupation.released


def test_a_failed_capture_leaves_the_graphs_released(monkeypatch):
    runner = make_runner("tiny-qwen3-next")
    graphs = runner.graph_runner = CudaGraphRunner(runner, [1, 2], use_graphs=False)
    runner.memory_occupation.release(["weights"])

    def no_memory():
        graphs.decode.outputs[1] = "half captured"
        raise RuntimeError("out of memory")

    monkeypatch.setattr(graphs, "_capture_all", no_memory)
    with pytest.raises(RuntimeError):
        runner.memory_occupation.resume(["weights"])
    assert runner.memory_occupation.released == {"cuda_graph"} and graphs.decode.outputs == {}
    monkeypatch.undo()
    runner.memory_occupation.resume(["cuda_graph"])
    assert graphs.decode.outputs and not runner.memory_occupation.released


def test_no_capture_while_anything_is_released(monkeypatch):
    """A weight update that changes a float8 KV scale, and a model swap, capture the graphs again (they hold
    the scales and the weights' addresses), but not while a tag is released: with the KV cache released
    the capture would write slot 0 of the emptied pools (an illegal access on CUDA), with the graphs
    released it would bring them back while the tag says released. The resume that leaves nothing
    released captures them, once."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.loaded_weights import LoadedWeights

    runner = make_runner("tiny-qwen3-next", kv_cache_dtype="fp8_e4m3")
    graphs = runner.graph_runner = CudaGraphRunner(runner, [1, 2], use_graphs=False)
    captures = []
    real = graphs._capture_all
    monkeypatch.setattr(graphs, "_capture_all", lambda: (captures.append(1), real()))
    name = next(n for n, m in runner.model.named_modules() if isinstance(m, RadixAttention))
    attn, scale = runner.model.get_submodule(name), name.rpartition(".")[0] + ".k_scale"
    occupation = runner.memory_occupation
    for i, tag in enumerate(["kv_cache", "cuda_graph", "kv_cache"]):
        occupation.release([tag])
        if i < 2:
            runner.update_weights_from_tensor([(scale, torch.tensor(0.5 + i))])
            assert attn.kv_scales == (0.5 + i, 1.0)  # (set now; the graphs take it at the resume)
        else:
            runner.swap_model(LoadedWeights(runner.model, runner.draft_model))
        assert captures == [1] * i and occupation.released == {tag}
        assert (graphs.decode.outputs == {}) == (tag == "cuda_graph")
        occupation.resume([tag])
        assert captures == [1] * (i + 1) and graphs.decode.outputs and not occupation.released
    runner.update_weights_from_tensor([(scale, torch.tensor(0.25))])  # nothing released: at once
    assert captures == [1] * 4
