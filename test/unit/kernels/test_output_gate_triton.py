"""Qwen3-Next's attention output gate in one Triton launch (layers/attention/triton_ops/output_gate.py, the
CUDA path, SGLANG_GPU_ELEMENTWISE_BACKEND): against the torch form `out * sigmoid(gate.reshape(T, -1))`
under `TRITON_INTERPRET=1` on small shapes with the gate cut out of q_proj's rows (strided), compiled for
sm_90 at the 80B's shapes; the layer's choice. Through the engine against the oracle:
test_cuda_path_on_cpu.py (CUDA_DEFAULT_ENV forces it)."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.layers.attention.triton_ops.output_gate import sigmoid_gate_mul
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=4, suite="per-commit-cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,heads,d", [(1, 2, 16), (5, 3, 24), (0, 2, 8)])
def test_matches_the_torch_form(kernel_device, dtype, tokens, heads, d):
    g = torch.Generator().manual_seed(heads * d + tokens)
    qg = (torch.randn(tokens, heads, 2 * d, generator=g) * 3).to(kernel_device, dtype)
    gate = qg[..., d:]  # each head's second half: token stride 2 H D, head stride 2 D
    out = torch.randn(tokens, heads * d, generator=g).to(kernel_device, dtype)
    got = sigmoid_gate_mul(out, gate)
    want = out * torch.sigmoid(gate.reshape(tokens, heads * d))
    assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # exp's ulp, one product
    else:
        # Two roundings to bfloat16 (the sigmoid, the product) as torch makes them; the interpreter
        # truncates where torch rounds to nearest, and a GPU's exp may move a rounding: one step each.
        torch.testing.assert_close(got.float(), want.float(), rtol=2 * 2**-7, atol=1e-5)


def test_compiles_for_sm90():
    """Qwen3-Next-80B: 16 query heads of 256 (a rank's at TP 1), bfloat16; compiles for an H100 from
    this CPU machine without spilling to local memory."""
    from sglang.srt.layers.attention.triton_ops import output_gate as mod
    from sglang.test.sm90 import compile_sm90_in_registers

    sig = {"out_ptr": "*bf16", "gate_ptr": "*bf16", "res_ptr": "*bf16", "out_stride": "i64",
           "gate_tstride": "i64", "gate_hstride": "i64", **{k: "constexpr" for k in ("HEADS", "D", "BH", "BD")}}  # fmt: skip
    compile_sm90_in_registers(mod._sigmoid_gate_mul_kernel, sig, dict(HEADS=16, D=256, BH=16, BD=256))


def test_the_attention_layer_takes_it_where_the_choice_says(monkeypatch):
    """auto on CUDA (not on these CPU weights), triton anywhere (interpreted on CPU tensors), torch
    nowhere. (The layer's output through it: the engine's, test_cuda_path_on_cpu.py.)"""
    from types import SimpleNamespace

    from sglang.srt.environ import envs
    from sglang.srt.models.qwen3_next import Qwen3NextAttention

    cfg = SimpleNamespace(
        hidden_size=32, attention_bias=False, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.25, max_position_embeddings=64,
    )  # fmt: skip
    layer = Qwen3NextAttention(cfg, 3)
    for backend, want in (("auto", False), ("torch", False), ("triton", True)):
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        with envs.SGLANG_GPU_ELEMENTWISE_BACKEND.override(backend):
            layer.process_weights_after_loading()
        assert (layer.gate_mul is not None) is want, backend
