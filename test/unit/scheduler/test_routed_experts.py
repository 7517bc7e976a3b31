"""return_routed_experts (upstream's, with --enable-return-routed-experts): meta_info["routed_experts"], the
experts each MoE layer's router picked for every position the model ran, base64 int32 [prompt + output
- 1, num_hidden_layers, top_k] (model_executor/routed_experts.py).

Against the transformers oracle (`output_router_logits`: the top-k of each MoE layer's softmax, in the
router's order): cold prompts, a prefix hit (the cached positions' routing is the one computed when the
prefix was), chunked prefill, overlap on and off, the decode graphs' bodies, mixed chunks, a batch of
requests of which some ask. The refusals: the flag off (a 400 naming the field), a checkpoint without
routed experts, the host tier and PD at start.
"""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from sglang.srt.managers.request_error import RequestError
from sglang.srt.server_args import ServerArgs, ServerArgsError
from sglang.test.ci_register import register_cpu_ci
from sglang.test.scheduler_harness import ORACLE_TOL, SchedulerHarness, token_ids

register_cpu_ci(est_time=30, suite="per-commit-cpu")

QWEN = "tiny-qwen3-next"


def decode(out, layers: int, top_k: int) -> np.ndarray:
    return np.frombuffer(base64.b64decode(out.routed_experts), dtype="<i4").reshape(-1, layers, top_k)


def oracle_routes(oracle, ids: list[int], top_k: int) -> np.ndarray:
    """[positions, layers, top_k]: each layer's softmax top-k over the router's logits (all layers MoE)."""
    with torch.no_grad():
        logits = oracle.model(torch.tensor([ids]), output_router_logits=True).router_logits
    picks = [torch.topk(torch.softmax(r.float(), -1), top_k, -1).indices for r in logits]
    return torch.stack(picks, dim=1).numpy()


@pytest.mark.parametrize(
    "preset,flags",
    [
        (QWEN, dict(disable_overlap_schedule=False)),
        (QWEN, dict(disable_overlap_schedule=True, chunked_prefill_size=64, enable_mixed_chunk=True)),
        ("tiny-qwen3.5-moe", dict(chunked_prefill_size=64)),
        ("tiny-granite-4.0-h", dict()),
    ],
    ids=lambda v: str(v),
)
def test_routes_match_the_oracles_routers(preset, flags, oracles):
    oracle = oracles[preset]
    h = SchedulerHarness(preset, enable_return_routed_experts=True, mamba_scheduler_strategy="extra_buffer", **flags)
    if preset == QWEN and not flags["disable_overlap_schedule"]:
        h.use_graph_bodies([1, 2, 4, 8])  # the decode graphs' bodies record into the fixed rows
    hf = h.server_args.model_config.arch.hf_config
    layers, k = hf.num_hidden_layers, hf.num_experts_per_tok
    try:
        shared = token_ids(300, seed=1)  # (past Granite's 256-token cache chunk)
        prompts = [shared + token_ids(20, seed=2), token_ids(90, seed=3), token_ids(70, seed=5), shared + token_ids(9, seed=4)]  # fmt: skip
        first = h.generate(prompts[0], 7, return_routed_experts=True)
        # Beside each other: one that asks, one that does not, and a prefix hit on the first prompt.
        rids = [h.submit(p, 9, return_routed_experts=asks) for p, asks in zip(prompts[1:], (True, False, True), strict=True)]
        h.run()
        outs = [first, *(h.outputs[r] for r in rids)]
        assert outs[2].routed_experts is None  # (it did not ask)
        assert outs[3].cached_tokens > 0  # (a prefix hit: the routing of the cached positions too)
        for prompt, out in zip([prompts[0], prompts[1], prompts[3]], [outs[0], outs[1], outs[3]], strict=True):
            h.check_oracle(oracle, prompt, out, ORACLE_TOL)
            got = decode(out, layers, k)
            ran = prompt + out.output_ids[:-1]
            assert got.shape == (len(ran), layers, k), got.shape
            want = oracle_routes(oracle, ran, k)
            assert (got == want).all(), f"{out.rid}: {(got != want).any(axis=(1, 2)).nonzero()[0][:8]} differ"
        h.flush_and_check_empty()
    finally:
        h.shutdown()


@pytest.mark.parametrize("preset", ["tiny-lfm2-moe", "tiny-nemotron-h"])
def test_hybrids_with_dense_layers_fill_those_with_zeros(preset):
    """LFM2-MoE's first layer and Nemotron-H's non-MoE layers route nothing: 0s there, as upstream's; the
    MoE layers' picks are distinct experts of the layer, and a prefix hit returns the cold run's rows."""
    h = SchedulerHarness(preset, enable_return_routed_experts=True, mamba_scheduler_strategy="extra_buffer")
    hf = h.server_args.model_config.arch.hf_config
    layers, k = hf.num_hidden_layers, hf.num_experts_per_tok
    try:
        prompt = token_ids(140, seed=5)
        cold = h.generate(prompt, 4, return_routed_experts=True)
        hit = h.generate(prompt, 4, return_routed_experts=True)
        assert hit.cached_tokens > 0
        a, b = decode(cold, layers, k), decode(hit, layers, k)
        assert a.shape == (len(prompt) + 3, layers, k) and (a == b).all()
        moe = [i for i in range(layers) if a[:, i].any()]
        assert 0 < len(moe) < layers, moe
        for i in moe:
            picks = a[:, i]
            assert (np.sort(picks, axis=1)[:, 1:] != np.sort(picks, axis=1)[:, :-1]).all()  # k distinct
        h.flush_and_check_empty()
    finally:
        h.shutdown()


def test_requests_and_flags_that_cannot_have_routes_are_refused(tmp_path):
    from sglang.srt.managers.io_struct import GenerateReqInput
    from sglang.srt.managers.request_limits import RequestLimits
    from sglang.srt.managers.request_validation import normalize_generate_request

    limits = RequestLimits(context_len=4096, max_req_input_len=4095, vocab_size=512)
    with pytest.raises(RequestError, match="--enable-return-routed-experts") as e:
        normalize_generate_request(GenerateReqInput(input_ids=[5, 6], return_routed_experts=True), None, limits)
    assert e.value.param == "return_routed_experts"
    with pytest.raises(RequestError, match="must be a boolean"):
        normalize_generate_request(GenerateReqInput(input_ids=[5, 6], return_routed_experts="yes"), None, limits)
    on = RequestLimits(context_len=4096, max_req_input_len=4095, vocab_size=512, routed_experts_enabled=True)
    (req,), _ = normalize_generate_request(GenerateReqInput(input_ids=[5, 6], return_routed_experts=True), None, on)
    assert req.req.return_routed_experts
    for flags in (dict(enable_hierarchical_cache=True), dict(disaggregation_mode="prefill")):
        with pytest.raises(ServerArgsError, match="^--enable-return-routed-experts is not supported with"):
            ServerArgs(model_path=QWEN, enable_return_routed_experts=True, **flags)
    with pytest.raises(ServerArgsError, match="needs a mixture-of-experts checkpoint"):
        SchedulerHarness("tiny-bamba", enable_return_routed_experts=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_routes_from_cuda_graph_replays_match_the_oracle(oracles):
    """On CUDA (float32) the decode steps replay CUDA graphs, which write the routing into the capture's
    fixed rows; the rows committed after each replay are transformers' routers' picks."""
    oracle = oracles[QWEN]
    h = SchedulerHarness(QWEN, enable_return_routed_experts=True, device="cuda", dtype="float32")
    assert h.sched.model_runner.graph_runner is not None
    hf = h.server_args.model_config.arch.hf_config
    try:
        prompts = [token_ids(40 + 9 * i, seed=20 + i) for i in range(3)]
        rids = [h.submit(p, 12, return_routed_experts=True) for p in prompts]
        h.run()
        for p, rid in zip(prompts, rids, strict=True):
            out = h.outputs[rid]
            ran = p + out.output_ids[:-1]
            got = decode(out, hf.num_hidden_layers, hf.num_experts_per_tok)
            assert (got == oracle_routes(oracle, ran, hf.num_experts_per_tok)).all(), rid
        h.flush_and_check_empty()
    finally:
        h.shutdown()


def test_an_aborted_request_returns_no_routes():
    """An abort may come while a chunk of the prompt is still queued on the forward stream (review: its
    rows then held the previous owner's routing, and prompt + output - 1 rows did not match): no rows."""
    h = SchedulerHarness(QWEN, enable_return_routed_experts=True, chunked_prefill_size=64)
    try:
        rid = h.submit(token_ids(200, seed=9), 4, return_routed_experts=True)
        h.sched.step()
        h.sched.abort_request(rid)
        h.run()
        out = h.outputs[rid]
        assert out.finished_reason["type"] == "abort" and out.routed_experts is None
        done = h.generate(token_ids(200, seed=9), 4, return_routed_experts=True)
        assert decode(done, 4, 2).shape == (203, 4, 2)  # (a request that finishes has them)
        h.flush_and_check_empty()
    finally:
        h.shutdown()


def test_a_graph_body_always_records_the_routing():
    """With nobody reading the routes (no host table, no distribution recording) an eager forward skips
    the copy; a CUDA graph's body, its warm-up as its capture (`utils/graph_capture.graph_body`), always
    records, since the graph's replays serve later forwards that may read them."""
    from sglang.srt.model_executor.expert_distribution import ExpertDistribution
    from sglang.srt.model_executor.routed_experts import RoutedExpertsCapture
    from sglang.srt.utils.graph_capture import graph_body

    capture = RoutedExpertsCapture(num_layers=2, top_k=2, kv_slots=0, device="cpu", rows=4)
    capture.distribution = ExpertDistribution(2, 4, [0, 1], 10, "cpu")  # (--expert-distribution-recorder-mode)
    assert not capture.distribution.recording
    ids = torch.tensor([[3, 1], [2, 0]], dtype=torch.int32)
    capture.record(1, ids)
    assert not capture.rows.any()
    with graph_body():
        capture.record(1, ids)
    assert torch.equal(capture.rows[:2, 1], ids) and not capture.rows[:, 0].any()
