"""sgl-kernel's C++ routed experts (`sgl-kernel/csrc/moe_cpu.cpp`) against a per-token float64 reference
and the grouped-GEMM torch path: gated and plain experts with every activation the op knows, tiles of 1
to 5 tokens per expert and idle experts, top-1 and top-k, outputs narrower and wider than a register
block and not a multiple of it, bfloat16 weights; the layer's shared expert (gated or not) in the same call;
bad routing refused; `RoutedExperts` keeps its weights' values when it stores them transposed (its shared
expert's too), keeps large experts on the GEMMs, and the engine decodes alike with either path."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers.activation import get_act_fn
from sglang.srt.layers.mlp import GatedMLP, PlainMLP
from sglang.srt.layers.moe.experts import CPU_OP_ACTIVATIONS, RoutedExperts
from sglang.test.ci_register import register_cpu_ci
from sglang.test.model_checks import greedy_tokens_and_logprobs, make_runner, max_abs

register_cpu_ci(est_time=6, suite="per-commit-cpu")

# float32 sums (of up to 300 terms here) against the reference's float64: measured <= 3e-6 of the
# output's scale; 1e-5 of it is far below a wrong expert, weight or activation (O(0.1) changes).
TOL = 1e-5


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return max_abs(got, want) < TOL * max(1.0, want.abs().max().item())


def _layer(experts: int, hidden: int, inter: int, act: str, gated: bool, seed: int = 0) -> RoutedExperts:
    torch.manual_seed(seed)
    m = RoutedExperts(experts, hidden, inter, act, gated)
    torch.nn.init.normal_(m.w13, std=0.2)
    torch.nn.init.normal_(m.w2, std=0.2)
    return m


def _reference(m: RoutedExperts, x, weights, ids) -> torch.Tensor:
    act, inter = get_act_fn(_act_name(m)), m.intermediate_size
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist(), strict=True):
            h = m.w13[e].double() @ x[t].double()
            h = act(h[:inter]) * h[inter:] if m.gated else act(h)
            out[t] += w * (m.w2[e].double() @ h)
    return out


def _act_name(m: RoutedExperts) -> str:
    return next(name for name, code in CPU_OP_ACTIVATIONS.items() if code == m.act_code)


def _run(ops, m: RoutedExperts, x, weights, ids) -> torch.Tensor:
    w13t, w2t = m.w13.transpose(1, 2).contiguous(), m.w2.transpose(1, 2).contiguous()
    return ops.moe_experts(x, w13t, w2t, weights, ids, m.gated, m.act_code)


def _routing(tokens: int, experts: int, top_k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    weights, ids = torch.randn(tokens, experts, generator=g).softmax(-1).topk(top_k)
    return weights, ids


@pytest.mark.parametrize("act,gated", [("silu", True), ("relu2", False), ("relu", False), ("gelu", True)])
@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 17, 40])
def test_op_matches_the_reference(ops, act, gated, tokens):
    # 4 experts, top-2: with 17 tokens an expert serves 5-12 (a tile of 8 where 8 are left, then tiles of 4,
    # then 1 to 3), with 40 about 20 (tiles of 8, then the rest); with 1 some idle.
    m = _layer(4, 48, 40, act, gated)  # outputs of 80 / 40 and 48 columns: a register block plus a rest
    x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(tokens))
    weights, ids = _routing(tokens, 4, 2, seed=tokens)
    assert _close(_run(ops, m, x, weights, ids), _reference(m, x, weights, ids))


@pytest.mark.parametrize("hidden,inter,top_k", [(64, 32, 1), (96, 300, 3), (320, 64, 2)])
@pytest.mark.parametrize("baseline", [False, True])
@pytest.mark.parametrize("tokens", [9, 40])
def test_op_at_narrow_and_wide_outputs(ops, hidden, inter, top_k, baseline, tokens):
    """600 gate+up rows and 320 hidden outputs: past the register width, whole rows are streamed.
    `baseline`: the SSE2 twin a CPU without AVX2 runs (SGLANG_TEST_CPU_OPS_BASELINE). 40 tokens give
    experts 8 or more: tiles of 8 in both widths."""
    m = _layer(6, hidden, inter, "silu", True, seed=1)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(2))
    weights, ids = _routing(tokens, 6, top_k, seed=3)
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        got = _run(ops, m, x, weights, ids)
    assert _close(got, _reference(m, x, weights, ids))


@pytest.mark.parametrize("tokens", [6, 40])
def test_op_with_bfloat16_weights(ops, tokens):
    m = _layer(4, 64, 32, "silu", True, seed=4)
    m.w13.data, m.w2.data = m.w13.data.bfloat16(), m.w2.data.bfloat16()
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(5))
    weights, ids = _routing(tokens, 4, 2, seed=6)
    # Same bf16 weights on both sides, float32 arithmetic in the op: float32 rounding only.
    assert _close(_run(ops, m, x, weights, ids), _reference(m, x, weights, ids))


@pytest.mark.parametrize("baseline", [False, True])
def test_silu_at_extreme_inputs(ops, baseline):
    """The op's silu (a vectorised exp) at inputs far outside exp's range: 0 below -88 (exp's own clamp
    would give h / 1.6e38 there: -0.6 at -1e38), h above, NaN for NaN and -inf (as torch's silu), against
    float64 (1e-6 absolute: the exp's 8e-8 relative error at |h| <= 88)."""
    inf, nan = float("inf"), float("nan")
    h = torch.tensor([-inf, -3e38, -1e30, -100.0, -88.5, -20.0, -1.0, 0.0, 1.0, 20.0, 100.0, 1e30, inf, nan])
    n = h.numel()
    # One expert of one input and one intermediate unit, plain: out = w2 * silu(w13 * x) = silu(x).
    w13t, w2t = torch.ones(1, 1, 1), torch.ones(1, 1, 1)
    with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
        got = ops.moe_experts(
            h[:, None], w13t, w2t, torch.ones(n, 1), torch.zeros(n, 1, dtype=torch.long), False, 0
        )
    want = torch.nn.functional.silu(h.double())
    want[(h < -88) & (h > -inf)] = 0.0
    torch.testing.assert_close(got[:, 0].double(), want, rtol=1e-6, atol=1e-6, equal_nan=True)


def _shared(hidden: int, inter: int, act: str, gated: bool, seed: int):
    torch.manual_seed(seed)
    mlp = GatedMLP(hidden, inter, act) if gated else PlainMLP(hidden, inter, act)
    gate = torch.nn.Linear(hidden, 1, bias=False) if gated else None  # Qwen3-Next's gate; Nemotron-H has none
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return mlp, gate


def _shared_reference(mlp, gate, x) -> torch.Tensor:
    out = mlp.down_proj(mlp.act(mlp.gate_proj(x)) * mlp.up_proj(x)) if hasattr(mlp, "gate_proj") else mlp(x)
    return out.double() * (torch.sigmoid(gate(x)).double() if gate is not None else 1.0)


@pytest.mark.parametrize("act,gated", [("silu", True), ("relu2", False)])
@pytest.mark.parametrize("tokens,threads", [(1, 1), (6, 1), (40, 1), (40, 2)])
@pytest.mark.parametrize("baseline", [False, True])
def test_op_adds_the_shared_expert(ops, act, gated, tokens, threads, baseline):
    """The shared expert's intermediate size (72) differs from the routed ones' (40); 6 tokens are a tile of 4
    and one of 2; 40 tokens are three tasks of at most 16 (on one thread or two)."""
    m = _layer(4, 48, 40, act, gated, seed=10)
    mlp, gate = _shared(48, 72, act, gated, seed=11)
    x = torch.randn(tokens, 48, generator=torch.Generator().manual_seed(12))
    weights, ids = _routing(tokens, 4, 2, seed=13)
    want = _reference(m, x, weights, ids) + _shared_reference(mlp, gate, x)
    up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]) if gated else mlp.up_proj.weight
    args = (up.t().contiguous(), mlp.down_proj.weight.t().contiguous())
    args += (gate.weight.reshape(-1).contiguous(),) if gate is not None else ()
    w13t, w2t = m.w13.transpose(1, 2).contiguous(), m.w2.transpose(1, 2).contiguous()
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with envs.SGLANG_TEST_CPU_OPS_BASELINE.override(baseline):
            got = ops.moe_experts(x, w13t, w2t, weights, ids, gated, m.act_code, *args)
    finally:
        torch.set_num_threads(before)
    assert _close(got, want)
    with pytest.raises(RuntimeError, match="shared_w13t must be"):
        ops.moe_experts(x, w13t, w2t, weights, ids, gated, m.act_code, args[1], args[0])
    with pytest.raises(RuntimeError, match="come together"):
        ops.moe_experts(x, w13t, w2t, weights, ids, gated, m.act_code, args[0])


@pytest.mark.parametrize("tokens", [1, 16, 200, 300])
@pytest.mark.parametrize("gated", [True, False])
def test_layer_fuses_its_shared_expert(ops, tokens, gated):
    """`fuse_shared_expert` keeps the shared MLP's weights' values and shapes (now views of the op's
    transposed copy); the layer's output is the same with the shared expert inside the op (decode sizes),
    added by torch beside the op (200 tokens: past CPU_OP_MAX_SHARED_TOKENS) or beside the GEMMs (300 x 4
    tokens: past BATCHED_MAX_ASSIGNMENTS), and equal to the float64 reference."""
    act = "silu" if gated else "relu2"
    m = _layer(8, 64, 32, act, gated, seed=14)
    mlp, gate = _shared(64, 48, act, gated, seed=15)
    x = torch.randn(tokens * 4 if tokens == 300 else tokens, 64, generator=torch.Generator().manual_seed(16))
    weights, ids = _routing(x.shape[0], 8, 2, seed=17)
    before = m.forward(x, weights, ids, mlp, gate)
    down = mlp.down_proj.weight.detach().clone()
    m.fuse_shared_expert(mlp, gate)
    m.fuse_shared_expert(mlp, gate)  # load_model may reach it twice: nothing moves again
    assert m.fused_shared == (mlp, gate) and torch.equal(mlp.down_proj.weight, down)
    assert mlp.down_proj.weight.t().is_contiguous()
    after = m.forward(x, weights, ids, mlp, gate)
    assert _close(after, before)
    assert _close(after, _reference(m, x, weights, ids) + _shared_reference(mlp, gate, x))


def test_a_shared_expert_unlike_the_routed_ones_stays_in_torch(ops):
    m = _layer(4, 48, 40, "silu", True, seed=18)
    for mlp, gate in [
        _shared(48, 72, "relu2", False, seed=19),  # not gated
        (GatedMLP(48, 72, "silu", bias=True), None),  # biases
        (GatedMLP(48, 72, "gelu"), None),  # another activation
    ]:
        m.fuse_shared_expert(mlp, gate)
        assert m.fused_shared is None


def test_bad_routing_is_refused(ops):
    m = _layer(4, 48, 16, "silu", True)  # w13 [4, 32, 48]: its untransposed shape is refused
    x = torch.randn(3, 48)
    weights, ids = _routing(3, 4, 2, seed=0)
    with pytest.raises(RuntimeError, match="outside the 4 experts"):
        _run(ops, m, x, weights, torch.tensor([[0, 1], [2, 4], [1, 3]]))
    with pytest.raises(RuntimeError, match="outside the 4 experts"):
        _run(ops, m, x, weights, torch.tensor([[0, 1], [2, -1], [1, 3]]))
    with pytest.raises(RuntimeError, match="shaped like topk_ids"):
        _run(ops, m, x, weights[:, :1].contiguous(), ids)
    with pytest.raises(RuntimeError, match="w13t must be"):
        ops.moe_experts(x, m.w13.contiguous(), m.w2.transpose(1, 2).contiguous(), weights, ids, True, 0)
    with pytest.raises(RuntimeError, match="at least one expert"):
        _run(ops, m, x, weights[:, :0].contiguous(), ids[:, :0].contiguous())
    with pytest.raises(RuntimeError, match="activation must be"):
        ops.moe_experts(
            x, m.w13.transpose(1, 2).contiguous(), m.w2.transpose(1, 2).contiguous(), weights, ids, True, 7
        )


@pytest.mark.parametrize("tokens", [1, 16, 300])
def test_layer_serves_from_the_transposed_weights(ops, tokens):
    """After `process_weights_after_loading` the parameters keep their values and shapes; decode sizes run
    the op, more than BATCHED_MAX_ASSIGNMENTS assignments the per-expert GEMMs; both as before."""
    m = _layer(8, 64, 32, "silu", True, seed=7)
    x = torch.randn(tokens * 4 if tokens == 300 else tokens, 64, generator=torch.Generator().manual_seed(8))
    weights, ids = _routing(x.shape[0], 8, 2, seed=9)
    before = m.forward(x, weights, ids)
    w13 = m.w13.detach().clone()
    m.process_weights_after_loading()
    assert m.cpu_ops is not None and m.w13.transpose(1, 2).is_contiguous() and torch.equal(m.w13, w13)
    after = m.forward(x, weights, ids)
    assert _close(after, before)
    assert _close(after, _reference(m, x, weights, ids))


def test_large_experts_and_the_torch_switch_keep_the_gemms(ops):
    big = _layer(2, 512, 256, "silu", True)  # 393k weights per expert: the GEMMs measured faster
    big.process_weights_after_loading()
    assert big.cpu_ops is None and big.w13.is_contiguous()
    small = _layer(2, 64, 32, "silu", True)
    with envs.SGLANG_CPU_MOE_BACKEND.override("torch"):
        small.process_weights_after_loading()
    assert small.cpu_ops is None and small.w13.is_contiguous()


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_engine_decodes_alike_with_cpp_and_torch_experts(ops, preset):
    """A 3-request extend (180 tokens x top-2: the op, below 1,024 assignments), then 10 greedy decode
    steps: the same tokens and logprobs within float32 noise."""

    def run(backend: str):
        with envs.SGLANG_CPU_MOE_BACKEND.override(backend):
            runner = make_runner(preset)
        layers = [m for m in runner.model.modules() if isinstance(m, RoutedExperts)]
        assert layers and all((m.cpu_ops is not None) == (backend == "cpp") for m in layers)
        # Both presets' shared experts run inside the op with it.
        assert all((m.fused_shared is not None) == (backend == "cpp") for m in layers)
        return greedy_tokens_and_logprobs(runner, (7, 60, 113), steps=10)

    with_cpp, with_torch = run("cpp"), run("torch")
    assert with_cpp[0] == with_torch[0]
    # float32 sums in other orders through every layer; measured ~1e-6.
    assert max_abs(with_cpp[1], with_torch[1]) < 1e-4
