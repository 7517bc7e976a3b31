"""Every architecture served here loads its NVIDIA ModelOpt FP8 form (issue 53; the per-commit file,
test_modelopt_fp8.py, covers Nemotron-H, whose releases are published so; Falcon-H1R-7B-FP8 is too):
each tiny checkpoint written by `make_tiny_model --quantize fp8-modelopt` (every quantizable linear FP8
with its per-tensor scale, lm_head kept) serves exactly its dequantized weights on CPU, for every
model's name mapping, folded multipliers, fused and split projections; in CUDA's layout (built on the
CPU) every FP8 linear's dequantized weight is that model's parameter within float32's rounding of a
folded multiplier, or within one e4m3 rounding where the layout requantizes (REQUANTIZED). Nightly: writing the nine checkpoints takes ~15 s."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.layers.quantization.fp8 import Fp8BlockLinear, Fp8Layout
from sglang.srt.models.registry import build_meta_model, load_model
from sglang.test.ci_register import register_cpu_ci
from sglang.test.reference import dequantized_checkpoint
from sglang.tools.make_tiny_model import ARCHS, make_tiny_model

register_cpu_ci(est_time=15, suite="nightly-cpu")

# Where CUDA's layout requantizes what it cannot keep (docs/server.md, "Quantized checkpoints"): Granite's
# shared MLP split off the 128-row grid (the tiny's halves are 64 rows), Falcon-H1's per-row muP vectors.
REQUANTIZED = ("granitemoehybrid", "falcon_h1")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_serves_its_modelopt_fp8_form(arch, tmp_path):
    path = str(tmp_path)
    make_tiny_model(arch, path, quantize="fp8-modelopt")
    cfg = load_hf_config(path)
    served = load_model(cfg, path, torch.float32, "cpu").state_dict()
    ref_path = dequantized_checkpoint(path)
    want = load_model(load_hf_config(ref_path), ref_path, torch.float32, "cpu").state_dict()
    assert served.keys() == want.keys()
    assert all(torch.equal(served[k], want[k]) for k in served), [
        k for k in served if not torch.equal(served[k], want[k])
    ]
    model = load_model(
        cfg, path, torch.float32, "cpu", meta=build_meta_model(cfg, "cpu", Fp8Layout(True, False))
    )
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Fp8BlockLinear)}
    assert linears, "no FP8 linear in CUDA's layout"
    for name, m in linears.items():
        got, ref = m.dequantized_weight(torch.float32), want[name + ".weight"]
        if arch in REQUANTIZED:
            # Requantized at load (documented): within one more e4m3 rounding of each block.
            step = m.weight_scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[
                : ref.shape[0], : ref.shape[1]
            ]
            assert ((got - ref).abs() <= 2**-4 * ref.abs() + 2**-10 * step).all(), name
        else:
            # The checkpoint's bytes: a multiplier folded into the scale rounds once in float32 (2^-24).
            assert torch.allclose(got, ref, rtol=2**-22, atol=0), name
