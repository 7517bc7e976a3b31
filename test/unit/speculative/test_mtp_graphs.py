"""The MTP layer's CUDA graphs (`speculative/mtp_graphs.py`) against the eager MTP layer. On CPU in their
CPU form (`use_graphs=False`: the captured body runs eagerly on the static buffers at every replay): the
draft loop's drafts and the KV they write are the eager loop's (a plan with a prefix rewrite of the
request table among them), padded requests write only the dummy row and slot 0, the graphs follow the
target runner's release (`can_run` then says no, and nothing of their memory stays referenced) and
recapture (a swapped model's lm_head read), a body that reads a host value is refused; the MTP layer after
a replayed decode leaves the eager layer's stash rows and KV, and the graph runner keeps no replayed batch
alive. On a GPU (the `gpu` tests) the same comparisons run with real CUDA graphs against the eager path,
float32: the teacher-drafts tests of test_speculative_mtp would pass whatever the graphs drafted."""

from __future__ import annotations

import dataclasses
import gc
from types import SimpleNamespace

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.model_executor.cuda_graph_runner import CudaGraphRunner, GraphUnsafeError
from sglang.srt.model_executor.forward_batch_info import ForwardMode, SamplingBatchInfo
from sglang.srt.speculative.mtp_draft import DraftPlan, MtpDraftRunner, MtpHook
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, random_ids
from sglang.test.mtp_checks import assert_mtp_layer_graphs_match
from sglang.test.runner_driver import Extend, RunnerDriver

register_cpu_ci(est_time=8, suite="per-commit-cpu")

QWEN = "tiny-qwen3-next"
STEPS = 3
SIZES = [1, 2, 4]
on_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _state(runner, draft) -> dict[str, torch.Tensor]:
    kv = runner.token_to_kv_pool
    return {
        "req_to_token": runner.req_to_token_pool.req_to_token.cpu().clone(),
        "kv": torch.stack([torch.stack(pair) for pair in zip(kv.k_buffer, kv.v_buffer, strict=True)]).cpu(),
        "stash": draft.stash.hidden.cpu().clone(),
    }


def _restore(runner, draft, state) -> None:
    runner.req_to_token_pool.req_to_token.copy_(state["req_to_token"])
    kv = runner.token_to_kv_pool
    for n, (k, v) in enumerate(zip(kv.k_buffer, kv.v_buffer, strict=True)):
        k.copy_(state["kv"][n, 0])
        v.copy_(state["kv"][n, 1])
    draft.stash.hidden.copy_(state["stash"])


def _draft_loops_graph_vs_eager(device: str):
    """Five draft plans run by the eager loop, then from the same state through the draft loop's graphs
    (real CUDA graphs on CUDA, float32; their CPU form elsewhere): the same drafts, the same KV within
    the tolerance, the same request table. Returns the runner, the draft runner and the plans."""
    on_cuda = device == "cuda"
    kw = dict(device="cuda", dtype="float32", disable_cuda_graph=True) if on_cuda else {}
    runner = make_runner(QWEN, speculative_algorithm="NEXTN", **kw)
    draft = MtpDraftRunner(runner)
    assert draft.graphs is None  # (no graph runner: the eager loop)
    driver = RunnerDriver(runner)
    reqs = [driver.new_request() for _ in range(5)]
    prompts = [random_ids(9 + 13 * i, seed=i) for i in range(5)]

    def prefill_with_mtp(fb):  # the MTP layer's KV over the prompts and each request's stash row
        fb.spec = MtpHook(draft, next_ids=[t for p in prompts for t in p[1:] + [-1]], completes=[True] * 5)
        return runner.forward_batch_generation(fb)

    driver.extend([Extend(r, p) for r, p in zip(reqs, prompts, strict=True)], False, forward=prefill_with_mtp)

    def plan(picked, temperature=0.0, writes=()):
        chosen = [reqs[i] for i in picked]
        return DraftPlan(
            rows=[r.req_pool_idx for r in chosen],
            prefix_lens=[r.seq_len for r in chosen],
            slots=[driver._alloc_kv(r, STEPS) for r in chosen],  # positions P .. P + k - 1
            writes=list(writes),
            sampling_info=SamplingBatchInfo.create([temperature] * len(chosen)),
            steps=STEPS,
        )

    # Buckets 1 (exact), 4 (one padded request), 2 (exact); five sampling requests are over the largest
    # bucket: the eager loop, which draws their drafts. The bucket-4 plan rewrites request 0's first four
    # table entries to request 1's KV slots (a prefix hit's shared prefix), before its draft steps: its MTP
    # attention then reads request 1's MTP KV there. The last plan samples and fits bucket 2: a graph
    # serves it with greedy drafts (before, a sampling plan always ran the eager loop), which the eager
    # side computes from its greedy twin (same rows and slots).
    shared = reqs[1].kv_slots[:4]
    plans = [
        plan([2]),
        plan([0, 3, 4], writes=[(reqs[0].req_pool_idx, 0, shared)]),
        plan([4, 1]),
        plan(range(5), temperature=1.0),
        plan([1, 3], temperature=1.0),
    ]
    greedy_twin = dataclasses.replace(plans[-1], sampling_info=SamplingBatchInfo.create([0.0, 0.0]))
    start = _state(runner, draft)
    draft.generator.manual_seed(7)  # (the eager sampling plan draws the same drafts in both runs)
    eager = [draft.draft_steps(p) for p in plans[:-1] + [greedy_twin]]
    after_eager = _state(runner, draft)

    _restore(runner, draft, start)
    runner.graph_runner = CudaGraphRunner(runner, SIZES, use_graphs=on_cuda)
    draft.use_graphs(runner.graph_runner)
    assert draft.graphs is not None and draft.graphs.bs_list == SIZES
    assert bool(draft.graphs.graphs) == on_cuda  # (real graphs on CUDA)
    draft.generator.manual_seed(7)
    graphs = [draft.draft_steps(p) for p in plans]
    after_graphs = _state(runner, draft)
    assert draft.graphs.replays == 4
    assert [d.chains for d in graphs] == [d.chains for d in eager]
    # Greedy drafts (no distributions) from every graph and from the all-greedy eager plans; the eager
    # sampling plan's drafts come with the distributions they were drawn from.
    assert [d.greedy for d in graphs] == [d.greedy for d in eager] == [True, True, True, False, True]
    assert graphs[3].probs.shape == (5, STEPS, runner.model.lm_head.weight.shape[0])
    # SGLANG_MTP_EAGER_SAMPLED_DRAFTS keeps sampling plans on the eager loop (sampled drafts).
    with envs.SGLANG_MTP_EAGER_SAMPLED_DRAFTS.override(True):
        assert not draft.graphs.can_run(plans[-1]) and draft.graphs.can_run(plans[0])

    # The drafted slots' MTP KV: the same kernels per row, only the matmuls see padded rows (CPU float32:
    # summation blocking, ~1e-7, so 1e-5; CUDA float32: cuBLAS may pick another kernel for the padded
    # shape, ~1e-6 per matmul over k - 1 MTP steps, so 1e-4, the target graphs' GPU test's bound); a
    # padded request writing a real slot, or the rewrite skipped, moves a row by O(1).
    tol = 1e-4 if on_cuda else 1e-5
    torch.testing.assert_close(after_graphs["kv"], after_eager["kv"], rtol=tol, atol=tol)
    assert torch.equal(after_graphs["stash"], start["stash"])  # (the draft loop keeps no g)
    # Padded requests (and the captures) write only request row 0 and KV slot 0: every other row and
    # slot holds the eager run's values exactly (the rewrite included), and slots no plan drafted into
    # are untouched.
    assert after_graphs["req_to_token"][reqs[0].req_pool_idx, :4].tolist() == shared
    assert torch.equal(after_graphs["req_to_token"][1:], after_eager["req_to_token"][1:])
    written = torch.zeros(start["kv"].shape[2], dtype=torch.bool)
    written[[s for p in plans for slots in p.slots for s in slots[: STEPS - 1]]] = True
    assert (after_graphs["kv"][:, :, written] != start["kv"][:, :, written]).any()  # (the MTP layer wrote)
    written[0] = True
    assert torch.equal(after_graphs["kv"][:, :, ~written], start["kv"][:, :, ~written])
    return runner, draft, plans


def test_graph_drafts_are_the_eager_loops(monkeypatch):
    runner, draft, plans = _draft_loops_graph_vs_eager("cpu")

    # The capture bookkeeping with stand-in graphs (`capture_each`, shared with the target's runner): a
    # size whose capture fails is left out (its plans replay the next larger size), a graph-unsafe body
    # stops the capture.
    import sglang.srt.speculative.mtp_graphs as mtp_graphs

    def capture(body, device, pool):
        out = body()
        if out.shape[0] == 2:
            raise RuntimeError("out of graph memory")
        return object(), out

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(mtp_graphs, "capture_graph", capture)
    stand_in = mtp_graphs.MtpDraftGraphs(draft, SIZES, STEPS, use_graphs=True)
    stand_in.capture()
    assert stand_in.bs_list == [1, 4] and sorted(stand_in.graphs) == [1, 4]

    def unsafe(body, device, pool):
        raise GraphUnsafeError("read a host list")

    monkeypatch.setattr(mtp_graphs, "capture_graph", unsafe)
    with pytest.raises(GraphUnsafeError):
        mtp_graphs.MtpDraftGraphs(draft, SIZES, STEPS, use_graphs=True).capture()

    # Under TP only the sizes every rank captured are kept (review R2 finding 1): here another rank could
    # not capture size 2. Kept, this rank would replay a 2-request sampling plan (greedy drafts) while
    # that rank ran it eagerly (sampled drafts, draws from the draft generator): other verify tokens, and
    # generators out of step for good. The MTP layer after a forward (padded rows in its collectives, as
    # the target's) keeps the same keys. At one rank nothing is dropped (`bs_list == SIZES` above).
    import sglang.srt.model_executor.cuda_graph_runner as cuda_graph_runner

    gathered = []

    def two_ranks(mine):
        gathered.append(list(mine))
        return [mine, [k for k in mine if k not in (2, (ForwardMode.DECODE, 2))]]

    monkeypatch.setattr(mtp_graphs, "capture_graph", lambda body, device, pool: (object(), body()))
    monkeypatch.setattr(cuda_graph_runner, "tp_gather", two_ranks)
    agreed = mtp_graphs.MtpDraftGraphs(draft, SIZES, STEPS, use_graphs=True)
    agreed.capture()
    assert gathered == [[4, 2, 1]]  # (this rank's captured sizes, in capture order)
    assert agreed.bs_list == [1, 4] and sorted(agreed.graphs) == sorted(agreed.outputs) == [1, 4]
    assert agreed.can_run(plans[-1])  # (2 requests: bucket 4 now, on every rank)
    forward = mtp_graphs.MtpForwardGraphs(draft, runner.graph_runner)
    forward.capture()
    assert (ForwardMode.DECODE, 2) not in forward.outputs and (ForwardMode.DECODE, 4) in forward.outputs
    monkeypatch.undo()

    # Released with the target's graphs (the loop runs eagerly meanwhile, and the target runner's
    # `can_run` says no: before, it kept its sizes and a replay would have found no graph) and captured
    # again with them.
    target = runner.graph_runner
    decode = SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=2)
    assert target.can_run(decode)
    target.release()
    assert draft.graphs.bs_list == [] and not draft.graphs.can_run(plans[0])
    assert target.bs_list == [] and not target.can_run(decode)
    target.recapture()
    assert draft.graphs.bs_list == SIZES and draft.graphs.can_run(plans[0])
    assert target.bs_list == SIZES and target.can_run(decode)
    # A weight update that swaps the model captures them again, now reading the new model's lm_head and
    # embedding (before, the draft kept the first model's: stale drafts, and its memory held).
    captured = draft.graphs.outputs[1]
    runner.swap_model(runner.load_like_current(QWEN))
    assert draft.lm_head is runner.model.lm_head and draft.embed is runner.model.model.embed_tokens
    assert draft.graphs.outputs[1] is not captured and draft.graphs.bs_list == SIZES
    # Dropped (bench_speculative_mtp's eager side): released now and left out of a recapture.
    dropped = draft.graphs
    target.remove_companion(dropped)
    target.recapture()
    assert dropped not in target.companions and dropped.bs_list == [] and not dropped.outputs

    # Negative control: the torch-native SDPA decode sizes itself from the batch's host lengths.
    with envs.SGLANG_CPU_ATTN_BACKEND.override("torch"), pytest.raises(GraphUnsafeError, match="host list"):
        MtpDraftRunner(runner)


def test_the_mtp_layer_after_a_replayed_decode_is_the_eager_one():
    """The MTP layer after a decode that replayed the target's graph (three requests: bucket 4, one
    padded request) runs its own graph on the target's static buffers and output: the stash rows it
    leaves and the KV it writes are the eager layer's (`assert_mtp_layer_graphs_match`; the verify's:
    the nightly file). With the torch rotary ops: they keep their cos / sin in the batch's `rope_cache`
    (the C++ and Triton ones compute them in the kernel)."""
    with envs.SGLANG_CPU_ROPE_BACKEND.override("torch"):
        run = assert_mtp_layer_graphs_match("decode", "cpu")
    # The graph runner holds no replayed batch: before, it kept the last one (and its hook: a verify's
    # draft distributions, [requests, k, vocab] float32, ~290 MB at 160 x 3 x 152k) until the next replay.
    gc.collect()
    assert run.last_batch() is None
    # Released: no captured batch keeps the rotary cos / sin its last capture left (the MTP layer's, in
    # that graph's pool); captured again: computed again, and the MTP layer after a decode is served.
    target = run.runner.graph_runner
    batches = [fb for graphs in target.kinds.values() for fb in graphs.batches.values()]
    assert all(fb.rope_cache for fb in batches)
    target.release()
    assert not any(fb.rope_cache for fb in batches)
    assert not run.draft.forward_graphs.outputs
    target.recapture()
    assert all(fb.rope_cache for fb in batches)
    assert sorted(bs for _, bs in run.draft.forward_graphs.outputs) == SIZES


# On CUDA: real CUDA graphs against the eager path (the GPU tests of test_speculative_mtp compare tokens
# only, which teacher drafts make independent of what the graphs draft).
@pytest.mark.gpu
@on_gpu
def test_gpu_graph_drafts_are_the_eager_loops():
    _draft_loops_graph_vs_eager("cuda")


@pytest.mark.gpu
@on_gpu
@pytest.mark.parametrize("kind", ["decode", "verify"])
def test_gpu_the_mtp_layer_after_a_replayed_forward_is_the_eager_one(kind):
    run = assert_mtp_layer_graphs_match(kind, "cuda")
    assert bool(run.draft.forward_graphs.graphs)  # (real graphs)
