"""The RMSNorm family's Triton kernel (layers/rmsnorm_triton.py, the CUDA path) against the modules' torch
form: under `TRITON_INTERPRET=1` on small shapes (non-power-of-2 widths, groups, strided rows, float32
and bfloat16), compiled for sm_90 at the real models' shapes, and through the engine."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers import rmsnorm_triton as tri
from sglang.srt.layers.layernorm import GatedRMSNorm, GroupedGatedRMSNorm, RMSNorm
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="per-commit-cpu")



def _module(cls, dtype, seed, **kwargs):
    g = torch.Generator().manual_seed(seed)
    m = cls(**kwargs)
    m.weight.data = (torch.randn(m.weight.shape, generator=g) * 0.5 + (0 if kwargs.get("offset_one") else 1)).to(dtype)
    return m


def _check(got: torch.Tensor, want: torch.Tensor, roundings: int = 1) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        # The same float32 arithmetic with the sum of squares in another order: ~1e-7 relative.
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        return
    # bfloat16: the kernel rounds where the torch form rounds, but Triton's interpreter truncates a
    # cast to bfloat16 where the GPU (and torch) round to nearest (half of all casts differ by one step,
    # measured), and on a GPU exp / sqrt / divide intrinsics may differ by an ulp, which can move a
    # rounding; so each of the form's `roundings` may put the result one bfloat16 step (up to 2^-7
    # relative) off; a wrong norm, gate or weight is off by far more.
    torch.testing.assert_close(got.float(), want.float(), rtol=roundings * 2**-7, atol=1e-5)


DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,offset_one", [(64, True), (96, False), (40, True)])
def test_plain_norm_matches_the_torch_form(kernel_device, dtype, hidden, offset_one):
    m = _module(RMSNorm, dtype, 1, hidden_size=hidden, eps=1e-6, offset_one=offset_one).to(kernel_device)
    x = (torch.randn(7, hidden, generator=torch.Generator().manual_seed(2)) * 3).to(kernel_device, dtype)
    _check(tri.rmsnorm_triton(x, m.weight, m.eps, tri.PLAIN, offset_one=offset_one), m(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norm_of_a_strided_view(kernel_device, dtype):
    """Qwen3-Next's q_norm: [tokens, heads, head_dim] split out of a wider projection (rows strided)."""
    heads, d = 3, 32
    m = _module(RMSNorm, dtype, 3, hidden_size=d, eps=1e-6, offset_one=True).to(kernel_device)
    qg = torch.randn(5, heads, 2 * d, generator=torch.Generator().manual_seed(4)).to(kernel_device, dtype)
    q = qg[..., :d]
    assert not q.is_contiguous()
    _check(tri.rmsnorm_triton(q, m.weight, m.eps, tri.PLAIN, offset_one=True), m(q))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dv", [32, 24])
def test_gated_norm_matches_the_torch_form(kernel_device, dtype, dv):
    m = _module(GatedRMSNorm, dtype, 5, hidden_size=dv, eps=1e-6).to(kernel_device)
    g = torch.Generator().manual_seed(6)
    x, gate = (torch.randn(4, 3, dv, generator=g).to(kernel_device, dtype) for _ in range(2))
    _check(tri.rmsnorm_triton(x, m.weight, m.eps, tri.GATE_AFTER, gate=gate), m(x, gate), roundings=3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,group", [(128, 32), (96, 24), (64, 64)])
@pytest.mark.parametrize("gate_first", [True, False])  # Nemotron-H's; Falcon-H1's norm before gate
def test_grouped_gated_norm_matches_the_torch_form(kernel_device, dtype, hidden, group, gate_first):
    m = _module(
        GroupedGatedRMSNorm, dtype, 7, hidden_size=hidden, group_size=group, eps=1e-5, gate_first=gate_first
    ).to(kernel_device)
    g = torch.Generator().manual_seed(8)
    x, gate = (torch.randn(6, hidden, generator=g).to(kernel_device, dtype) for _ in range(2))
    want = m(x, gate)
    got = tri.rmsnorm_triton(
        x, m.weight, m.eps, tri.GATE_FIRST if gate_first else tri.GATE_AFTER, gate=gate, group_size=group,
        out_dtype=torch.promote_types(m.weight.dtype, x.dtype),
    )  # fmt: skip
    _check(got, want, roundings=2 if gate_first else 3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_and_norm_matches_the_add_then_the_norm(kernel_device, dtype):
    """`add_rmsnorm_triton` (the decoder layer's residual add fused into the next norm) against torch's
    add and the module's torch form: the sum (one rounding) and its norm (two: the sum's and the norm's)."""
    m = _module(RMSNorm, dtype, 5, hidden_size=96, eps=1e-6, offset_one=True).to(kernel_device)
    g = torch.Generator().manual_seed(6)
    x, residual = ((torch.randn(5, 96, generator=g) * 3).to(kernel_device, dtype) for _ in range(2))
    normed, total = tri.add_rmsnorm_triton(x, residual, m.weight, m.eps, offset_one=True)
    _check(total, residual + x)
    _check(normed, m(residual + x), roundings=2)
    assert torch.equal(m.add_and_norm(x, residual)[1], residual + x)  # the torch form of the module


def test_a_wrong_group_changes_the_result(interpret):
    """The control: normalising over the whole row instead of each group is visibly different, so the
    grouped comparison above can fail."""
    m = _module(GroupedGatedRMSNorm, torch.float32, 7, hidden_size=64, group_size=16, eps=1e-5)
    x, gate = torch.randn(3, 64), torch.randn(3, 64)
    got = tri.rmsnorm_triton(x, m.weight, m.eps, tri.GATE_FIRST, gate=gate, group_size=64)
    assert (got - m(x, gate)).abs().max() > 1e-2


def test_an_empty_batch_launches_nothing(interpret):
    w = torch.ones(16)
    out = tri.rmsnorm_triton(torch.zeros(0, 16), w, 1e-6)
    assert out.shape == (0, 16)


def test_the_modules_take_the_kernel_when_asked(interpret, monkeypatch):
    """`SGLANG_GPU_NORM_BACKEND=triton` (auto on CUDA) makes each module's forward the kernel; a bad
    value is one sentence naming the variable."""
    from sglang.srt.environ import envs

    m = _module(RMSNorm, torch.float32, 1, hidden_size=16, eps=1e-6)
    calls = []
    real = tri.rmsnorm_triton
    monkeypatch.setattr(tri, "rmsnorm_triton", lambda *a, **k: calls.append(a[3]) or real(*a, **k))
    with envs.SGLANG_GPU_NORM_BACKEND.override("triton"):
        m.process_weights_after_loading()
    assert m.triton and m.cpu_ops is not None  # the C++ op stays chosen for CPU, the kernel goes first
    m(torch.randn(2, 16))
    assert calls == [tri.PLAIN]
    fused = []
    monkeypatch.setattr(tri, "add_rmsnorm_triton", lambda *a, **k: fused.append(1) or (a[0], a[1]))
    m.add_and_norm(torch.randn(2, 16), torch.randn(2, 16))
    assert fused == [1]
    with envs.SGLANG_GPU_NORM_BACKEND.override("torch"):
        m.process_weights_after_loading()
    assert not m.triton
    with envs.SGLANG_GPU_NORM_BACKEND.override("fast"), pytest.raises(ValueError, match="SGLANG_GPU_NORM_BACKEND"):
        m.process_weights_after_loading()


@pytest.mark.parametrize("dtype", DTYPES)
def test_per_head_norms_read_strided_views_in_place(kernel_device, dtype):
    """[tokens, heads, D] views of a wider product (k out of a stacked GEMM's columns, the gated norm's
    z beside q|k|v) are normed where they lie: no copy first (rows at a token stride and a head stride),
    the torch form's values."""
    heads, d = 3, 16
    m = _module(RMSNorm, dtype, 5, hidden_size=d, eps=1e-6, offset_one=True).to(kernel_device)
    gm = _module(GatedRMSNorm, dtype, 6, hidden_size=d, eps=1e-6).to(kernel_device)
    wide = torch.randn(4, 7 * heads * d, generator=torch.Generator().manual_seed(7)).to(kernel_device, dtype)
    k = wide[:, heads * d : 2 * heads * d].view(4, heads, d)  # token stride 7 H D, head stride D
    z = wide[:, 5 * heads * d : 6 * heads * d].view(4, heads, d)
    x = torch.randn(4, heads, d, generator=torch.Generator().manual_seed(8)).to(kernel_device, dtype)
    for view in (k, z):  # what the kernel reads: the views themselves
        assert tri._token_head_rows(view, heads).data_ptr() == view.data_ptr()
    _check(tri.rmsnorm_triton(k, m.weight, m.eps, tri.PLAIN, offset_one=True), m(k))
    _check(tri.rmsnorm_triton(x, gm.weight, gm.eps, tri.GATE_AFTER, gate=z), gm(x, z), roundings=3)


@pytest.mark.parametrize("act", ["bf16", "fp32"])
def test_compiles_for_sm90(act):
    """Qwen3-Next-80B's hidden norm (2,048, offset one), its gated norm (head dim 128) and Nemotron-H-8B's
    grouped norm (8,192 channels in 8 groups) compile for an H100 from this CPU machine, without spilling
    to local memory."""
    from sglang.test.sm90 import compile_sm90_in_registers

    sig = {
        **{k: f"*{act}" for k in ("x_ptr", "gate_ptr", "w_ptr", "out_ptr", "res_ptr", "sum_ptr")},
        "x_stride": "i64", "gate_stride": "i64", "res_stride": "i64", "x_hstride": "i64",
        "gate_hstride": "i64", "heads": "i32", "eps": "fp32",
        **{k: "constexpr" for k in ("N", "G", "BG", "MODE", "OFFSET_ONE", "ROUND_PRODUCT", "HAS_RESIDUAL")},
    }  # fmt: skip
    rounding = act == "bf16"
    for n, g, mode, residual in (
        (2048, 2048, tri.PLAIN, False),
        (2048, 2048, tri.PLAIN, True),  # the fused residual add (`add_rmsnorm_triton`)
        (128, 128, tri.GATE_AFTER, False),
        (8192, 1024, tri.GATE_FIRST, False),
    ):
        consts = dict(N=n, G=g, BG=g, MODE=mode, OFFSET_ONE=mode == tri.PLAIN, ROUND_PRODUCT=rounding)
        compile_sm90_in_registers(tri._rmsnorm_kernel, sig, {**consts, "HAS_RESIDUAL": residual})


@pytest.mark.parametrize("preset", ["tiny-qwen3-next", "tiny-nemotron-h"])
def test_engine_through_the_kernel_as_through_the_torch_form(interpret, preset):
    """Prefill then 4 greedy decode steps of 2 requests with every norm of the model through the kernel
    (interpreted) and through the torch form: the same tokens and logprobs."""
    from sglang.srt.environ import envs
    from sglang.test.model_checks import greedy_tokens_and_logprobs, make_runner

    runs = []
    for backend in ("triton", "torch"):
        with envs.SGLANG_GPU_NORM_BACKEND.override(backend), envs.SGLANG_CPU_NORM_BACKEND.override("torch"):
            runner = make_runner(preset, mamba_scheduler_strategy="extra_buffer")
        norms = [m for m in runner.model.modules() if isinstance(m, (RMSNorm, GatedRMSNorm, GroupedGatedRMSNorm))]
        assert norms and all(m.triton == (backend == "triton") for m in norms)
        runs.append(greedy_tokens_and_logprobs(runner, (17, 26), steps=4))
    (tok_a, lp_a), (tok_b, lp_b) = runs
    assert tok_a == tok_b
    # The same float32 math with sums in another order (~1e-7 per norm); a wrong norm moves logprobs
    # by O(0.1).
    torch.testing.assert_close(lp_a, lp_b, rtol=1e-4, atol=1e-4)
