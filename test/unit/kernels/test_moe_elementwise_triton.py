"""The MoE elementwise kernels (layers/moe/elementwise_triton.py, the CUDA path) against torch's ops:
under `TRITON_INTERPRET=1` on small shapes (strided halves of one projection, widths past one block,
float32 and bfloat16, an empty batch), compiled for sm_90 at Qwen3-Next-80B's shapes without spills,
and through the engine (`test_moe_dispatch_triton.py`'s engine test spies on both)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sglang.srt.layers.moe import elementwise_triton as ew
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=8, suite="per-commit-cpu")


def _check(got: torch.Tensor, want: torch.Tensor, roundings: int) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    if want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)  # the same float32 ops in order
        return
    # bfloat16: each rounding torch makes may land one step (2^-7 relative) off: the interpreter
    # truncates a cast where a GPU rounds to nearest, and a GPU's exp may differ by an ulp.
    torch.testing.assert_close(got.float(), want.float(), rtol=roundings * 2**-7, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [24, 1500])  # one block; two (BLOCK 1024), the last one partial
def test_silu_mul_of_the_halves_of_one_projection(kernel_device, dtype, width):
    h = (torch.randn(5, 2 * width, generator=torch.Generator().manual_seed(width)) * 3).to(kernel_device, dtype)
    gate, up = h.split(width, dim=-1)  # rows strided by 2 * width
    _check(ew.silu_mul(gate, up), F.silu(gate) * up, roundings=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_sigmoid_mul_matches_the_shared_experts_torch_form(kernel_device, dtype):
    g = torch.Generator().manual_seed(3)
    out, shared = ((torch.randn(6, 1100, generator=g) * 2).to(kernel_device, dtype) for _ in range(2))
    gate = (torch.randn(6, 1, generator=g) * 4).to(kernel_device, dtype)
    got, want = ew.add_sigmoid_mul(out, shared, gate), out + torch.sigmoid(gate) * shared
    if dtype == torch.float32:
        _check(got, want, roundings=3)
        return
    # bfloat16: a one-step difference in the product's rounding stays one step of the operands' size
    # when out and the product cancel, so the bound scales with them, not with the result.
    scale = out.float().abs() + shared.float().abs()
    assert got.dtype == want.dtype and ((got.float() - want.float()).abs() <= 3 * 2**-7 * scale + 1e-5).all()


def test_a_wrong_gate_row_changes_the_result(kernel_device):
    g = torch.Generator().manual_seed(4)
    out, shared = (torch.randn(3, 40, generator=g).to(kernel_device) for _ in range(2))
    gate = torch.tensor([[-4.0], [0.0], [4.0]], device=kernel_device)
    got = ew.add_sigmoid_mul(out, shared, gate)
    swapped = out + torch.sigmoid(gate.flip(0)) * shared
    assert not torch.allclose(got, swapped, atol=1e-3)


def test_an_empty_batch_launches_nothing(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ew.silu_mul(torch.zeros(0, 8), torch.zeros(0, 8)).shape == (0, 8)
    assert ew.add_sigmoid_mul(torch.zeros(0, 8), torch.zeros(0, 8), torch.zeros(0, 1)).shape == (0, 8)


@pytest.mark.parametrize("act", ["bf16", "fp32"])
def test_compiles_for_sm90(act):
    """Qwen3-Next-80B: experts of 512 (the silu_mul of each half), the shared expert's 512, hidden 2,048
    (the gated add); each compiles for an H100 from this CPU machine without spilling."""
    from sglang.test.sm90 import compile_sm90_in_registers

    silu = {"gate_ptr": f"*{act}", "up_ptr": f"*{act}", "out_ptr": f"*{act}", "gate_stride": "i64",
            "up_stride": "i64", "N": "constexpr", "BN": "constexpr"}  # fmt: skip
    compile_sm90_in_registers(ew._silu_mul_kernel, silu, dict(N=512, BN=512))
    add = {**{k: f"*{act}" for k in ("out_ptr", "shared_ptr", "gate_ptr", "res_ptr")},
           **{k: "i64" for k in ("out_stride", "shared_stride", "gate_stride")}, "N": "constexpr", "BN": "constexpr"}  # fmt: skip
    compile_sm90_in_registers(ew._add_sigmoid_mul_kernel, add, dict(N=2048, BN=ew.BLOCK))
