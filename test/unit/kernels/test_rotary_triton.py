"""The rotary embedding's Triton kernel (layers/rotary_triton.py, the CUDA path) against the module's torch
form: under `TRITON_INTERPRET=1` on small shapes (partial and full rotary, strided q and k, float32 and
bfloat16), compiled for sm_90 at Qwen3-Next-80B's shape, and through the engine."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.rotary_embedding import RotaryEmbedding
from sglang.srt.layers.rotary_triton import rotary_triton
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=10, suite="per-commit-cpu")



@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim", [(32, 32), (64, 16), (24, 12)])
def test_matches_the_torch_form(kernel_device, dtype, head_dim, rotary_dim):
    rope = RotaryEmbedding(head_dim, rotary_dim, 10000.0).to(kernel_device)
    g = torch.Generator().manual_seed(head_dim + rotary_dim)
    positions = torch.tensor([0, 5, 17, 300, 4095], device=kernel_device)
    qg = torch.randn(5, 3, 2 * head_dim, generator=g).to(kernel_device, dtype)
    q = qg[..., :head_dim]  # strided, as split out of the projection
    k = torch.randn(5, 1, head_dim, generator=g).to(kernel_device, dtype)
    want_q, want_k = rope(positions, q, k)
    got_q, got_k = rotary_triton(positions, q, k, rope.inv_freq, rotary_dim)
    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
        # float32: cos / sin of the same float32 angle by another library (~1e-6 relative at angles up to
        # ~4,000 rad); bfloat16: one rounding of the float32 result, which Triton's interpreter truncates
        # where torch rounds to nearest, and which on a GPU an ulp of cos / sin can move (one bfloat16
        # step, 2^-7 relative at most).
        tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=1e-5)
        torch.testing.assert_close(got.float(), want.float(), **tol)
        # The channels past the rotary ones pass through unchanged.
        assert torch.equal(got[..., rotary_dim:], want[..., rotary_dim:])


def test_a_wrong_position_changes_the_result(interpret):
    """The control: rotating at other positions is visibly different, so the comparison can fail."""
    rope = RotaryEmbedding(16, 16, 10000.0)
    q, k = torch.randn(2, 2, 16), torch.randn(2, 1, 16)
    want_q, _ = rope(torch.tensor([3, 4]), q, k)
    got_q, _ = rotary_triton(torch.tensor([4, 3]), q, k, rope.inv_freq, 16)
    assert (got_q - want_q).abs().max() > 1e-2


def test_an_empty_batch_launches_nothing(interpret):
    rope = RotaryEmbedding(16, 16, 10000.0)
    q, k = rotary_triton(torch.zeros(0, dtype=torch.int64), torch.zeros(0, 2, 16), torch.zeros(0, 1, 16), rope.inv_freq, 16)
    assert q.shape == (0, 2, 16) and k.shape == (0, 1, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,rotary_dim,offset_one", [(64, 16, True), (32, 32, False), (24, 12, True)])
def test_the_heads_norms_in_the_same_launch(kernel_device, dtype, head_dim, rotary_dim, offset_one, monkeypatch):
    """`norms` (Qwen3-Next's q_norm / k_norm): each head normalised, rounded, then rotated, as
    rope(q_norm(q), k_norm(k)) in torch, on strided q (beside the output gate) and k (a column slice of
    a stacked product); `forward_with_norms` takes it where the norms run their kernel, else the three
    calls."""
    from sglang.srt.layers.layernorm import RMSNorm

    rope = RotaryEmbedding(head_dim, rotary_dim, 10000.0).to(kernel_device)
    g = torch.Generator().manual_seed(head_dim + rotary_dim)
    norms = [RMSNorm(head_dim, eps=1e-6, offset_one=offset_one) for _ in range(2)]
    for m in norms:
        m.weight.data = (torch.randn(head_dim, generator=g) * 0.3 + (0 if offset_one else 1)).to(kernel_device, dtype)
    positions = torch.tensor([0, 5, 17, 300, 4095], device=kernel_device)
    qg = (torch.randn(5, 3, 2 * head_dim, generator=g) * 2).to(kernel_device, dtype)
    q = qg[..., :head_dim]
    wide = (torch.randn(5, 3 * head_dim, generator=g) * 2).to(kernel_device, dtype)
    k = wide[:, head_dim : 2 * head_dim].view(5, 1, head_dim)
    want_q, want_k = rope(positions, norms[0](q), norms[1](k))
    for m in norms:
        m.triton = True  # (their Triton kernel chosen, as on CUDA)
    rope.triton = True
    from sglang.srt.layers import rmsnorm_triton as tri

    calls = []
    real_norm = tri.rmsnorm_triton
    monkeypatch.setattr(tri, "rmsnorm_triton", lambda *a, **kw: calls.append(1) or real_norm(*a, **kw))
    got_q, got_k = rope.forward_with_norms(positions, q, k, *norms)
    assert calls == []  # one launch: neither norm's own kernel ran
    def close(got, want):
        # float32: the norm's sum and cos / sin by other code (~1e-6 relative). bfloat16: the norm's
        # rounding may land one step apart (the interpreter truncates, torch rounds to nearest), and the
        # rotation mixes two such values, so an output is off by up to a step at the head's largest
        # magnitude (absolute), plus its own last rounding (relative); a wrong norm is off by O(1).
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        else:
            big = want.float().abs().max().item()
            torch.testing.assert_close(got.float(), want.float(), rtol=2**-7, atol=2 * big * 2**-8)

    for got, want in ((got_q, want_q), (got_k, want_k)):
        assert got.dtype == dtype and got.shape == want.shape and got.is_contiguous()
        close(got, want)
    # The norm kernel's rounded result rotated by the rotary kernel: round, then rotate. Bit for bit
    # under the interpreter (one summation order); on CUDA the two kernels' sums of squares run in
    # other trees (their blocks and warps differ: an H200 measured one float32 ulp apart at head 24),
    # so there the same tolerance as against torch.
    normed = [real_norm(t, m.weight, m.eps, tri.PLAIN, offset_one=offset_one) for t, m in zip((q, k), norms, strict=True)]
    apart = rotary_triton(positions, *normed, rope.inv_freq, rotary_dim)
    if got_q.device.type == "cpu":
        assert torch.equal(got_q, apart[0]) and torch.equal(got_k, apart[1])
    else:
        close(got_q, apart[0])
        close(got_k, apart[1])
    norms[1].triton = False  # a norm on its torch form: the three calls (q's norm its kernel), same values
    _, got_k2 = rope.forward_with_norms(positions, q, k, *norms)
    assert calls == [1]
    close(got_k2, want_k)
    norms[1].triton = True  # a hooked norm (its module must run): the three calls
    norms[1].register_forward_hook(lambda *a: calls.append("hook"))
    rope.forward_with_norms(positions, q, k, *norms)
    assert calls == [1, 1, 1, "hook"]


def test_mrope_positions_keep_their_own_rotation(interpret):
    """Qwen3.5-VL's mRoPE (positions [3, T]: temporal, height, width) shares Qwen3-Next's attention: with
    such positions `forward_with_norms` takes the subclass's rotation after the norms, not the fused
    kernel (which reads one position per token)."""
    from sglang.srt.layers.layernorm import RMSNorm
    from sglang.srt.models.multimodal_forward import MRotaryEmbedding

    rope = MRotaryEmbedding(RotaryEmbedding(64, 16, 10000.0), [2, 3, 3])
    rope.triton = True
    norms = [RMSNorm(64, eps=1e-6, offset_one=True) for _ in range(2)]
    for m in norms:
        m.triton = True
    g = torch.Generator().manual_seed(9)
    q, k = torch.randn(4, 2, 64, generator=g), torch.randn(4, 1, 64, generator=g)
    positions = torch.tensor([[0, 1, 2, 3], [0, 5, 9, 3], [0, 7, 1, 3]])
    want = rope(positions, norms[0](q), norms[1](k))
    got = rope.forward_with_norms(positions, q, k, *norms)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # (the same ops but the norms' kernel)
    text = rope.forward_with_norms(positions[0], q, k, *norms)  # 1-D: the plain rotation, fused
    assert (text[0] - got[0]).abs().max() > 1e-2  # the height / width turns differ from the temporal


@pytest.mark.parametrize("act", ["bf16", "fp32"])
@pytest.mark.parametrize("norm", [False, True])
def test_compiles_for_sm90(act, norm):
    """Qwen3-Next-80B's attention (16 query / 2 KV heads of 256, a quarter rotary), with its heads' norms
    in the launch and without, compiles for an H100 from this CPU machine, without spilling to local
    memory."""
    from sglang.srt.layers import rotary_triton as mod
    from sglang.test.sm90 import compile_sm90_in_registers

    sig = {
        "pos_ptr": "*i64", "inv_freq_ptr": "*fp32", **{k: f"*{act}" for k in ("q_ptr", "k_ptr", "q_out_ptr", "k_out_ptr")},
        **{k: "i64" for k in ("q_stride_t", "q_stride_h", "k_stride_t", "k_stride_h")},
        "qw_ptr": f"*{act}", "kw_ptr": f"*{act}", "q_eps": "fp32", "k_eps": "fp32",
        **{k: "constexpr" for k in ("HQ", "HK", "D", "HALF", "BHALF", "BREST", "NORM", "W_OFFSET", "BD")},
    }  # fmt: skip
    consts = dict(HQ=16, HK=2, D=256, HALF=32, BHALF=32, BREST=256, NORM=norm, W_OFFSET=1.0, BD=256)
    compile_sm90_in_registers(mod._rope_kernel, sig, consts)


def test_engine_through_the_kernel_as_through_the_torch_form(interpret):
    """tiny-qwen3-next (partial rotary): prefill then 4 greedy decode steps of 2 requests with the rotary
    embedding through the kernel (interpreted) and through the torch form: the same tokens and logprobs."""
    from sglang.srt.environ import envs
    from sglang.test.model_checks import greedy_tokens_and_logprobs, make_runner

    runs = []
    for backend in ("triton", "torch"):
        with envs.SGLANG_GPU_ROPE_BACKEND.override(backend), envs.SGLANG_CPU_ROPE_BACKEND.override("torch"):
            runner = make_runner("tiny-qwen3-next", mamba_scheduler_strategy="extra_buffer")
        ropes = [m for m in runner.model.modules() if isinstance(m, RotaryEmbedding)]
        assert ropes and all(m.triton == (backend == "triton") for m in ropes)
        runs.append(greedy_tokens_and_logprobs(runner, (17, 26), steps=4))
    (tok_a, lp_a), (tok_b, lp_b) = runs
    assert tok_a == tok_b
    # The same float32 rotation (cos / sin ~1e-6 apart); a wrong position or channel moves logprobs by
    # O(0.1).
    torch.testing.assert_close(lp_a, lp_b, rtol=1e-4, atol=1e-4)
