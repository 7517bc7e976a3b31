"""The MTP draft loop's CUDA graphs (`speculative/mtp_graphs.py`) in their CPU form (`use_graphs=False`:
the captured body runs eagerly on the static buffer at every replay): the drafts and the KV they write
are the eager loop's, padded requests write only the dummy row and slot 0, the graphs follow the target
runner's release and recapture (a swapped model's lm_head read), and a body that reads a host value is refused. On a GPU the same path
runs as real graphs in test_speculative_mtp's `gpu` test."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, GraphUnsafeError
from sglang.srt.model_executor.forward_batch_info import SamplingBatchInfo
from sglang.srt.speculative.mtp_draft import DraftPlan, MtpDraftRunner, MtpHook
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, random_ids
from sglang.test.mtp_checks import mtp_after_forward_run
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=5, suite="per-commit-cpu")

QWEN = "tiny-qwen3-next"
STEPS = 3
SIZES = [1, 2, 4]


def _state(runner, draft) -> dict[str, torch.Tensor]:
    kv = runner.token_to_kv_pool
    return {
        "req_to_token": runner.req_to_token_pool.req_to_token.clone(),
        "kv": torch.stack([torch.stack(pair) for pair in zip(kv.k_buffer, kv.v_buffer, strict=True)]),
        "stash": draft.stash.hidden.clone(),
    }


def _restore(runner, draft, state) -> None:
    runner.req_to_token_pool.req_to_token.copy_(state["req_to_token"])
    kv = runner.token_to_kv_pool
    for n, (k, v) in enumerate(zip(kv.k_buffer, kv.v_buffer, strict=True)):
        k.copy_(state["kv"][n, 0])
        v.copy_(state["kv"][n, 1])
    draft.stash.hidden.copy_(state["stash"])


def test_graph_drafts_are_the_eager_loops():
    runner = make_runner(QWEN, speculative_algorithm="NEXTN")
    draft = MtpDraftRunner(runner)
    assert draft.graphs is None  # (no graph runner on CPU unless a test installs one)
    driver = RunnerDriver(runner)
    reqs = [driver.new_request() for _ in range(5)]
    prompts = [random_ids(9 + 13 * i, seed=i) for i in range(5)]

    def prefill_with_mtp(fb):  # the MTP layer's KV over the prompts and each request's stash row
        fb.spec = MtpHook(draft, next_ids=[t for p in prompts for t in p[1:] + [-1]], completes=[True] * 5)
        return runner.forward_batch_generation(fb)

    driver.extend([Extend(r, p) for r, p in zip(reqs, prompts, strict=True)], False, forward=prefill_with_mtp)

    def plan(picked, temperature=0.0):
        chosen = [reqs[i] for i in picked]
        return DraftPlan(
            rows=[r.req_pool_idx for r in chosen],
            prefix_lens=[r.seq_len for r in chosen],
            slots=[driver._alloc_kv(r, STEPS) for r in chosen],  # positions P .. P + k - 1
            writes=[],
            sampling_info=SamplingBatchInfo.create([temperature] * len(chosen)),
            steps=STEPS,
        )

    # Buckets 1 (exact), 4 (one padded request), 2 (exact); five requests are over the largest bucket
    # and a sampling plan is never served by a graph: both run the eager loop.
    plans = [plan([2]), plan([0, 3, 4]), plan([4, 1]), plan(range(5)), plan([1, 3], temperature=1.0)]
    start = _state(runner, draft)
    draft.generator.manual_seed(7)  # (the sampling plan draws the same drafts in both runs)
    eager = [draft.draft_steps(p)[0] for p in plans]
    after_eager = _state(runner, draft)

    _restore(runner, draft, start)
    runner.graph_runner = CudaGraphRunner(runner, SIZES, use_graphs=False)
    draft.use_graphs(runner.graph_runner)
    assert draft.graphs is not None and draft.graphs.bs_list == SIZES
    draft.generator.manual_seed(7)
    graphs = [draft.draft_steps(p)[0] for p in plans]
    after_graphs = _state(runner, draft)
    assert draft.graphs.replays == 3
    assert graphs == eager

    # The drafted slots' MTP KV: the same kernels per row, only the matmuls see padded rows (float32
    # summation blocking: ~1e-7); a padded request writing a real slot moves a row by O(1).
    torch.testing.assert_close(after_graphs["kv"], after_eager["kv"], rtol=1e-5, atol=1e-5)
    assert torch.equal(after_graphs["stash"], start["stash"])  # (the draft loop keeps no g)
    # Padded requests (and the captures) write only request row 0 and KV slot 0: every other row and
    # slot holds the eager run's values exactly, and slots no plan drafted into are untouched.
    assert torch.equal(after_graphs["req_to_token"][1:], after_eager["req_to_token"][1:])
    written = torch.zeros(start["kv"].shape[2], dtype=torch.bool)
    written[[s for p in plans for slots in p.slots for s in slots[: STEPS - 1]]] = True
    assert (after_graphs["kv"][:, :, written] != start["kv"][:, :, written]).any()  # (the MTP layer wrote)
    written[0] = True
    assert torch.equal(after_graphs["kv"][:, :, ~written], start["kv"][:, :, ~written])

    # Released with the target's graphs (the loop runs eagerly meanwhile) and captured again with them.
    runner.graph_runner.release()
    assert draft.graphs.bs_list == [] and not draft.graphs.can_run(plans[0])
    runner.graph_runner.recapture()
    assert draft.graphs.bs_list == SIZES and draft.graphs.can_run(plans[0])
    # A weight update that swaps the model captures them again, now reading the new model's lm_head and
    # embedding (before, the draft kept the first model's: stale drafts, and its memory held).
    captured = draft.graphs.outputs[1]
    runner.swap_model(runner.load_like_current(QWEN))
    assert draft.lm_head is runner.model.lm_head and draft.embed is runner.model.model.embed_tokens
    assert draft.graphs.outputs[1] is not captured and draft.graphs.bs_list == SIZES

    # Negative control: the torch-native SDPA decode sizes itself from the batch's host lengths.
    with envs.SGLANG_CPU_ATTN_BACKEND.override("torch"), pytest.raises(GraphUnsafeError, match="host list"):
        MtpDraftRunner(runner)


@pytest.mark.parametrize("kind", ["decode"])  # (the verify's, Triton interpreted: the nightly file)
def test_the_mtp_layer_after_a_replayed_forward_is_the_eager_one(monkeypatch, kind):
    """The MTP layer after a decode or verify that replayed the target's graph (three requests: bucket 4,
    one padded request) runs its own graph on the target's static buffers and output: the stash rows it
    leaves and the KV it writes are the eager layer's (1e-5: padded rows only change the matmuls'
    float32 blocking; a padded position writing a real slot, or stale hidden rows, moves them by O(1))."""
    if kind == "verify":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    tok_g, stash_g, kv_g, replays = mtp_after_forward_run(kind, graphs=True)
    tok_e, stash_e, kv_e, _ = mtp_after_forward_run(kind, graphs=False)
    assert replays == 4
    assert tok_g == tok_e
    torch.testing.assert_close(stash_g, stash_e, rtol=1e-5, atol=1e-5)
    # Every KV slot but the dummy 0 (the padded positions write there).
    torch.testing.assert_close(kv_g[:, :, 1:], kv_e[:, :, 1:], rtol=1e-5, atol=1e-5)
