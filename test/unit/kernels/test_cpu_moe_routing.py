"""sgl-kernel's C++ top-k routing (`sgl-kernel/csrc/moe_routing_cpu.cpp`) against its torch twins in
`layers/moe/router.py`: Qwen3-Next's softmax top-k (renormalised or not) and Nemotron-H's biased grouped
sigmoid top-k, at the presets' shapes and others; a NaN logit never yields an expert id outside the layer;
bad arguments refused; large batches and layers keep the torch ops; the models pick the op at load where
the C++ op serves their experts (SGLANG_CPU_MOE_BACKEND)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.moe.router import (
    CPU_ROUTING_MAX_EXPERTS,
    CPU_ROUTING_MAX_TOKENS,
    grouped_sigmoid_topk,
    softmax_topk,
)
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import make_runner, max_abs

register_cpu_ci(est_time=3, suite="per-commit-cpu")

# Softmax / sigmoid of float32 logits in another summation order: ~1e-7 apart where measured; a wrong
# expert or a missing renormalisation moves a weight by O(0.01) or more.
TOL = 1e-6


def _logits(tokens: int, experts: int, seed: int) -> torch.Tensor:
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("tokens,experts,top_k", [(1, 8, 2), (16, 8, 2), (33, 64, 8), (5, 10, 10)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_matches_torch(ops, tokens, experts, top_k, renormalize):
    logits = _logits(tokens, experts, seed=tokens + experts)
    want_w, want_ids = softmax_topk(logits, top_k, renormalize)
    got_w, got_ids = softmax_topk(logits, top_k, renormalize, ops)
    assert torch.equal(got_ids, want_ids)
    assert got_w.dtype == torch.float32 and max_abs(got_w, want_w) < TOL


# (experts, groups, groups kept, top_k): the tiny Nemotron-H preset's routing, one group (no grouping),
# groups of one expert (their best single score), and a top_k that needs every kept group.
@pytest.mark.parametrize(
    "experts,groups,kept,top_k", [(8, 1, 1, 2), (16, 4, 2, 3), (8, 8, 3, 3), (12, 3, 2, 8)]
)
@pytest.mark.parametrize("renormalize", [True, False])
def test_biased_grouped_topk_matches_torch(ops, experts, groups, kept, top_k, renormalize):
    logits = _logits(17, experts, seed=experts + groups)
    bias = torch.randn(experts, generator=torch.Generator().manual_seed(1)) * 0.5
    args = (top_k, bias, groups, kept, renormalize, 2.5)
    want_w, want_ids = grouped_sigmoid_topk(logits, *args)
    got_w, got_ids = grouped_sigmoid_topk(logits, *args, ops=ops)
    assert torch.equal(got_ids, want_ids)
    assert max_abs(got_w, want_w) < TOL


def test_a_nan_logit_keeps_the_ids_inside_the_layer(ops):
    logits = _logits(3, 8, seed=2)
    logits[1] = float("nan")
    logits[2, 3] = float("nan")
    for weights, ids in [
        ops.topk_softmax(logits, 2, True),
        ops.biased_grouped_topk(logits, torch.zeros(8), 2, 2, 1, True, 1.0),
    ]:
        assert ((ids >= 0) & (ids < 8)).all()
        assert all(len(set(row)) == 2 for row in ids.tolist())  # distinct experts per token
        assert torch.isnan(weights[1]).all() and not torch.isnan(weights[0]).any()


class _MustNotRun:
    """Stands in for the ops where the torch path must run."""

    def __getattr__(self, name):
        raise AssertionError(f"the C++ routing op {name} ran")


def test_large_batches_and_layers_keep_the_torch_ops():
    """The C++ top-k serves at most CPU_ROUTING_MAX_TOKENS tokens of at most CPU_ROUTING_MAX_EXPERTS experts
    (one thread, a scan of the experts per pick: torch's ops measured faster beyond)."""
    many_tokens = _logits(CPU_ROUTING_MAX_TOKENS + 1, 8, seed=4)
    many_experts = _logits(4, CPU_ROUTING_MAX_EXPERTS + 1, seed=5)
    for logits in (many_tokens, many_experts):
        weights, ids = softmax_topk(logits, 2, True, _MustNotRun())
        assert torch.equal(ids, softmax_topk(logits, 2, True)[1])
        bias = torch.zeros(logits.shape[1])
        grouped_sigmoid_topk(logits, 2, bias, 1, 1, True, 1.0, ops=_MustNotRun())


def test_bad_arguments_are_refused(ops):
    logits = _logits(2, 8, seed=3)
    with pytest.raises(RuntimeError, match="top_k must be between 1 and the 8 experts"):
        ops.topk_softmax(logits, 9, True)
    with pytest.raises(RuntimeError, match="float32"):
        ops.topk_softmax(logits.double(), 2, True)
    with pytest.raises(RuntimeError, match="num_groups must divide"):
        ops.biased_grouped_topk(logits, torch.zeros(8), 2, 3, 1, True, 1.0)
    with pytest.raises(RuntimeError, match="topk_groups must be"):
        ops.biased_grouped_topk(logits, torch.zeros(8), 5, 4, 2, True, 1.0)  # 2 groups of 2 hold 4
    with pytest.raises(RuntimeError, match="correction_bias"):
        ops.biased_grouped_topk(logits, torch.zeros(7), 2, 2, 1, True, 1.0)


@pytest.mark.parametrize("backend", ["cpp", "torch"])
def test_models_pick_the_op_at_load(ops, backend):
    with envs.SGLANG_CPU_MOE_BACKEND.override(backend):
        qwen, nemotron = make_runner("tiny-qwen3-next"), make_runner("tiny-nemotron-h")
    blocks = [m for m in qwen.model.modules() if hasattr(m, "routing_ops")]
    routers = [m for m in nemotron.model.modules() if type(m).__name__ == "NemotronHTopkRouter"]
    assert blocks and routers
    assert all((m.routing_ops is not None) == (backend == "cpp") for m in blocks)
    assert all((m.cpu_ops is not None) == (backend == "cpp") for m in routers)
