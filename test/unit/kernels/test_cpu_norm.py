"""sgl-kernel's C++ RMSNorms (`sgl-kernel/csrc/norm_cpu.cpp`) against the modules' torch forms: plain with
and without the weight offset, over hidden rows and per-head rows (strided views, as q/k norms get them),
the gated norm of Qwen3-Next (norm, then gate) and the grouped one of Nemotron-H (gate, then a norm per
group); modules pick the op only for float32 weights; bad shapes are refused; the engine decodes alike."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.layernorm import GatedRMSNorm, GroupedGatedRMSNorm, RMSNorm
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import greedy_tokens_and_logprobs, make_runner, max_abs

register_cpu_ci(est_time=4, suite="per-commit-cpu")

# The same float32 arithmetic with the sum of squares in another order (and 1/sqrt for rsqrt): measured
# <= 5e-7 on values of O(1-3); a wrong weight, offset, gate or group is O(0.1) or more.
TOL = 1e-5


def _pair(module: torch.nn.Module, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the module's torch form, its C++ op) on the same inputs."""
    torch.nn.init.normal_(module.weight, std=0.5)
    want = module(*inputs)
    module.process_weights_after_loading()
    assert module.cpu_ops is not None
    return want, module(*inputs)


@pytest.mark.parametrize("offset_one", [False, True])
def test_rmsnorm_over_hidden_rows(ops, offset_one):
    want, got = _pair(RMSNorm(64, eps=1e-6, offset_one=offset_one), torch.randn(7, 64) * 3)
    assert max_abs(got, want) < TOL


def test_rmsnorm_over_heads_of_a_strided_view(ops):
    qg = torch.randn(5, 4, 32)
    q = qg.split(16, dim=-1)[0]  # [5, 4, 16], not contiguous, as Qwen3-Next's q before its q_norm
    want, got = _pair(RMSNorm(16, eps=1e-6, offset_one=True), q)
    assert got.shape == q.shape and max_abs(got, want) < TOL


@pytest.mark.parametrize("baseline", [False, True])
def test_gated_rmsnorm_norm_then_gate(ops, baseline):
    """`baseline`: the SSE2 twin a CPU without AVX2 runs (SGLANG_TEST_CPU_OPS_BASELINE)."""
    x, gate = torch.randn(6, 4, 16), torch.randn(6, 4, 16)
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        want, got = _pair(GatedRMSNorm(16, eps=1e-6), x, gate)
    assert max_abs(got, want) < TOL


@pytest.mark.parametrize("gate_first", [True, False])  # Nemotron-H's; Falcon-H1's norm before gate
def test_grouped_gated_rmsnorm_per_group(ops, gate_first):
    x, gate = torch.randn(6, 96), torch.randn(6, 96)
    grouped = GroupedGatedRMSNorm(96, group_size=24, eps=1e-5, gate_first=gate_first)
    want, got = _pair(grouped, x, gate)
    assert max_abs(got, want) < TOL
    # One norm over the whole row differs: the comparison above does check the grouping.
    whole = GroupedGatedRMSNorm(96, group_size=96, eps=1e-5, gate_first=gate_first)
    whole.weight.data.copy_(grouped.weight.data)
    assert max_abs(whole(x, gate), got) > 1e-2


def test_bfloat16_weights_keep_the_torch_form(ops):
    norm = RMSNorm(16).to(torch.bfloat16)
    norm.process_weights_after_loading()
    assert norm.cpu_ops is None
    with envs.SGLANG_CPU_NORM_BACKEND.override("torch"):
        forced = RMSNorm(16)
        forced.process_weights_after_loading()
    assert forced.cpu_ops is None


def test_bad_shapes_are_refused(ops):
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.rmsnorm(torch.zeros(2, 8), torch.zeros(6), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="float32"):
        ops.rmsnorm(torch.zeros(2, 8, dtype=torch.float64), torch.zeros(8), 1e-6, 0.0)
    with pytest.raises(RuntimeError, match="shaped like x"):
        ops.gated_rmsnorm(torch.zeros(2, 8), torch.zeros(2, 4), torch.zeros(8), 1e-6, 8, False)
    with pytest.raises(RuntimeError, match="group_size must divide"):
        ops.gated_rmsnorm(torch.zeros(2, 8), torch.zeros(2, 8), torch.zeros(8), 1e-6, 3, True)


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_engine_decodes_alike_with_cpp_and_torch_norms(ops, preset):
    def run(backend: str):
        with envs.SGLANG_CPU_NORM_BACKEND.override(backend):
            runner = make_runner(preset)
        norms = [
            m for m in runner.model.modules() if isinstance(m, RMSNorm | GatedRMSNorm | GroupedGatedRMSNorm)
        ]
        assert norms and all((m.cpu_ops is not None) == (backend == "cpp") for m in norms)
        return greedy_tokens_and_logprobs(runner, (9, 70), steps=8)

    with_cpp, with_torch = run("cpp"), run("torch")
    assert with_cpp[0] == with_torch[0]
    # float32 rounding differences through every layer; measured ~1e-6.
    assert max_abs(with_cpp[1], with_torch[1]) < 1e-4
