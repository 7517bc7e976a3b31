"""The MTP draft layer under the RL routes, by its drafts (nightly-cpu, ~100 s; the per-commit checks by
its parameters: test_mtp_weight_updates.py). `drafts`: the MTP layer's output g at each request's last
position after a prefill and two decodes (the stash each first draft is drawn from) and a greedy
3-step draft loop from it, through the CUDA-graph runners' CPU form. A runner brought to checkpoint B by
an update gives bit for bit what a runner loaded from B gives (the same values in the same parameters,
the same ops); after release and resume, what it gave before.

The demo model (a trained MTP layer): through the scheduler's routes, an MTP layer updated to noise
drafts what the model does not write (acceptance falls to about none), and a disk update back to the
demo checkpoint restores the drafts exactly (the same commits per verify as at start)."""

from __future__ import annotations

import pickle

import pytest
import torch

from sglang.srt.configs.presets import resolve_model_path
from sglang.srt.managers.io_struct import UpdateWeightFromDiskReqInput, UpdateWeightsFromTensorReqInput
from sglang.srt.speculative.mtp_draft import MtpDraftRunner
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, noisy_checkpoint
from sglang.test.mtp_checks import DEMO, held_out_prompts
from sglang.test.mtp_weight_checks import checkpoint_tensors, drafts, edit_mtp
from sglang.test.scheduler_harness import SchedulerHarness

register_cpu_ci(est_time=100, suite="nightly-cpu")

QWEN = "tiny-qwen3-next"


def nextn_runner(path: str, **kw):
    return make_runner(path, speculative_algorithm="NEXTN", **kw)


def assert_same_drafts(got, want) -> None:
    assert torch.equal(got[0], want[0]) and got[1] == want[1]


@pytest.fixture(scope="module")
def checkpoint_b(preset_paths, tmp_path_factory):
    path = noisy_checkpoint(preset_paths[QWEN], tmp_path_factory.mktemp("mtp") / "b")
    return path, drafts(nextn_runner(path))


def test_drafts_after_a_tensor_update_are_the_new_checkpoints(checkpoint_b):
    path, drafts_b = checkpoint_b
    runner = nextn_runner(QWEN)
    assert runner.update_weights_from_tensor(list(checkpoint_tensors(path).items())) == []
    assert_same_drafts(drafts(runner), drafts_b)
    # Negative control: the model's tensors alone (the MTP layer stays A's) give other drafts.
    runner = nextn_runner(QWEN)
    model_only = [(n, t) for n, t in checkpoint_tensors(path).items() if not n.startswith("mtp.")]
    assert runner.update_weights_from_tensor(model_only) == []
    assert not torch.equal(drafts(runner)[0], drafts_b[0])


def test_drafts_after_a_disk_update_through_graphs_captured_again(checkpoint_b):
    """The draft runner and its graph bodies made before the swap (as the server's are) draft with B's
    MTP layer after it: the swap captures them again, reading the runner's new layer."""
    path, drafts_b = checkpoint_b
    runner = nextn_runner(QWEN)
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4], use_graphs=False)
    draft = MtpDraftRunner(runner)
    runner.swap_model(runner.load_like_current(path))
    assert_same_drafts(drafts(runner, draft), drafts_b)


def test_release_and_resume_keep_the_drafts():
    from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner

    before = drafts(nextn_runner(QWEN))
    runner = nextn_runner(QWEN, enable_weights_cpu_backup=True)
    runner.graph_runner = CudaGraphRunner(runner, [1, 2, 4], use_graphs=False)
    draft = MtpDraftRunner(runner)
    runner.memory_occupation.release(["weights", "kv_cache", "cuda_graph"])
    assert sum(p.untyped_storage().nbytes() for p in runner.draft_model.parameters()) == 0
    assert draft.graphs.bs_list == []
    runner.memory_occupation.resume(["weights", "kv_cache", "cuda_graph"])
    assert draft.graphs.bs_list == [1, 2, 4]
    assert_same_drafts(drafts(runner, draft), before)


def commits_per_verify(h: SchedulerHarness, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """The greedy 32 tokens of each prompt and the tokens committed per verify on this run."""
    stats = dict(h.sched.spec.stats)
    rids = [h.submit(p, max_new_tokens=32, return_logprob=False) for p in prompts]
    h.run()
    now = h.sched.spec.stats
    steps = now["verify_steps"] - stats["verify_steps"]
    return [h.outputs[r].output_ids for r in rids], (
        now["committed_tokens"] - stats["committed_tokens"]
    ) / steps


def test_the_demo_models_routes_change_its_drafts(tmp_path):
    prompts = held_out_prompts(3, 96)
    h = SchedulerHarness(DEMO, disable_overlap_schedule=True, speculative_algorithm="NEXTN")
    try:
        outputs, trained = commits_per_verify(h, prompts)
        assert trained > 1.3  # (test_mtp_demo_acceptance: 1.58 measured, never-hit drafts give 1.0)
        # The MTP layer's tensors replaced by noise of their own scale, by value as an HTTP client sends.
        gen = torch.Generator().manual_seed(0)
        mtp = {n: t for n, t in checkpoint_tensors(resolve_model_path(DEMO)).items() if n.startswith("mtp.")}
        noise = [(n, t.std() * torch.randn(t.shape, generator=gen, dtype=t.dtype)) for n, t in mtp.items()]
        reply = h.control_reply(UpdateWeightsFromTensorReqInput([pickle.dumps(noise)], trusted=False))
        assert (reply.success, reply.message) == (
            True,
            f"Succeeded to update {len(mtp)} weight tensor(s) in place.",
        )
        noisy_outputs, noisy = commits_per_verify(h, prompts)
        assert noisy_outputs == outputs  # (the verify decides: greedy outputs never change)
        assert noisy < 1.1, noisy  # (random drafts over a 4k vocabulary: ~never accepted)
        # A disk update back to the demo checkpoint: its MTP layer again, the drafts as at start.
        reply = h.control_reply(UpdateWeightFromDiskReqInput(resolve_model_path(DEMO)))
        assert reply.success, reply.message
        assert commits_per_verify(h, prompts) == (outputs, trained)
        # And to a copy whose MTP layer is the noise: the new checkpoint's drafts.
        noisy_dir = edit_mtp(resolve_model_path(DEMO), tmp_path / "noisy_mtp", lambda _: dict(noise))
        reply = h.control_reply(UpdateWeightFromDiskReqInput(noisy_dir))
        assert reply.success, reply.message
        assert commits_per_verify(h, prompts) == (noisy_outputs, noisy)
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_release_and_disk_update_with_real_graphs(checkpoint_b):
    """On CUDA (float32, real CUDA graphs; not yet run on a GPU): released weights give the MTP layer's
    bytes back to the allocator, and after the resume (host copy) the graphs captured again draft as
    before; a disk update's recapture drafts with B's layer as a runner loaded from B does (1e-5: the
    same kernels on the same values, a kernel with atomics may round otherwise)."""

    def cuda_runner(path):
        runner = nextn_runner(path, device="cuda", dtype="float32", enable_weights_cpu_backup=True)
        assert runner.graph_runner is not None and runner.graph_runner.use_graphs
        return runner, MtpDraftRunner(runner)

    def close(got, want) -> None:
        torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
        assert got[1] == want[1]

    runner, draft = cuda_runner(QWEN)
    before = drafts(runner, draft)
    mtp_bytes = sum(p.numel() * p.element_size() for p in runner.draft_model.parameters())
    model_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    allocated = torch.cuda.memory_allocated()
    runner.memory_occupation.release(["weights", "cuda_graph"])
    assert allocated - torch.cuda.memory_allocated() >= model_bytes + mtp_bytes
    runner.memory_occupation.resume(["weights", "cuda_graph"])
    close(drafts(runner, draft), before)

    runner.swap_model(runner.load_like_current(checkpoint_b[0]))
    runner_b, draft_b = cuda_runner(checkpoint_b[0])
    close(drafts(runner, draft), drafts(runner_b, draft_b))
