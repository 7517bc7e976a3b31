"""Every architecture served here loads its NVIDIA ModelOpt FP8 form (issue 53; the per-commit file,
test_modelopt_fp8.py, covers Nemotron-H, whose releases are published so; Falcon-H1R-7B-FP8 is too):
each tiny checkpoint written by `make_tiny_model --quantize fp8-modelopt` (every quantizable linear FP8
with its per-tensor scale, lm_head kept) serves exactly its dequantized weights on CPU, for every
model's name mapping, folded multipliers, fused and split projections; in CUDA's layout (built on the
CPU) every FP8 linear's dequantized weight is that model's parameter within float32's rounding of a
folded multiplier, or within one e4m3 rounding where the layout requantizes (REQUANTIZED); and a copy that
keeps one layer dense (its tensors dequantized in the file, its ignore list unchanged) has no FP8 module in
that layer, whatever the model renames or splits, and serves its tensors as they are. Nightly: writing the nine checkpoints takes ~15 s."""

from __future__ import annotations

import pytest
import torch

from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.layers.moe.experts import RoutedExperts
from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, Fp8BlockLinear, Fp8Layout
from sglang.srt.models.registry import build_meta_model, load_model
from sglang.test.ci_register import register_cpu_ci
from sglang.test.fp8_partial import keep_dense
from sglang.test.reference import dequantized_checkpoint
from sglang.tools.make_tiny_model import ARCHS, make_tiny_model

register_cpu_ci(est_time=20, suite="nightly-cpu")

# Where CUDA's layout requantizes what it cannot keep (docs/server.md, "Quantized checkpoints"): Granite's
# shared MLP split off the 128-row grid (the tiny's halves are 64 rows), Falcon-H1's per-row muP vectors.
REQUANTIZED = ("granitemoehybrid", "falcon_h1")


@pytest.mark.parametrize("arch", ARCHS)
def test_every_architecture_serves_its_modelopt_fp8_form(arch, tmp_path):
    path = str(tmp_path / "ckpt")
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
    # Layer 1 kept dense in the file, its config's list left as it was (the tensors say it): nothing of our
    # layer 1 holds FP8 (the model's renames and splits followed), its parameters are the dequantized
    # tensors as they are, and the rest stays FP8.
    kept = keep_dense(path, tmp_path / "kept", ["*layers.1.*"], listed=[])
    cfg = load_hf_config(kept)
    meta = build_meta_model(cfg, "cpu", Fp8Layout(True, True))
    model = load_model(cfg, kept, torch.float32, "cpu", meta=meta)
    fp8 = {
        n
        for n, m in model.named_modules()
        if isinstance(m, Fp8BlockLinear) or (isinstance(m, RoutedExperts) and m.w13.dtype == FP8_DTYPE)
    }
    assert fp8 and not [n for n in fp8 if ".layers.1." in n], sorted(fp8)
    layer1 = {k: v for k, v in model.state_dict().items() if ".layers.1." in k}
    assert layer1 and all(torch.equal(v, want[k]) for k, v in layer1.items()), [
        k for k, v in layer1.items() if not torch.equal(v, want[k])
    ]
