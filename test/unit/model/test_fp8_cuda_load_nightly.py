"""The CUDA FP8 layout built on the CPU for a model that splits a fused checkpoint tensor and folds a
multiplier (issue 53, review item 1; the per-commit file is test_fp8_cuda_load.py): Granite's shared MLP
`input_linear` [gate | up] with 256-row halves (two whole 128-row blocks each) loads as its gate_proj and
up_proj with the checkpoint's bytes and their scale rows, and the residual multiplier folded into the
branch ends goes into their scales, the bytes unchanged. Every block is narrowed to 3/4 of e4m3's range
first (as in test_fp8_cuda_load.py), so a dequantize-and-requantize would change the bytes. Nightly:
writing the checkpoint takes ~10 s."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang.srt.configs.model_config import load_hf_config
from sglang.srt.layers.quantization.fp8 import FP8_DTYPE, SCALE_SUFFIX, Fp8Layout
from sglang.srt.models.registry import load_model
from sglang.test.ci_register import register_cpu_ci
from sglang.tools.make_tiny_model import make_tiny_model

register_cpu_ci(est_time=15, suite="nightly-cpu")


def test_granites_split_and_folded_multiplier_keep_the_checkpoints_bytes(tmp_path):
    make_tiny_model(
        "granitemoehybrid", tmp_path, overrides={"shared_intermediate_size": 256}, quantize="fp8-block"
    )
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    for name in [n for n in tensors if n.endswith(SCALE_SUFFIX)]:
        base = name.removesuffix(SCALE_SUFFIX)
        tensors[base] = (tensors[base].float() * 0.75).to(FP8_DTYPE)
        tensors[name] = tensors[name] / 0.75
    save_file(tensors, path, metadata={"format": "pt"})
    cfg = load_hf_config(str(tmp_path))
    model = load_model(cfg, str(tmp_path), torch.float32, "cpu", Fp8Layout(linears=True, experts=True))
    with safe_open(str(Path(tmp_path) / "model.safetensors"), "pt") as f:
        fused = "model.layers.0.shared_mlp.input_linear.weight"
        w, s = f.get_tensor(fused), f.get_tensor(fused + SCALE_SUFFIX)
        down = "model.layers.0.shared_mlp.output_linear.weight"
        dw, ds = f.get_tensor(down), f.get_tensor(down + SCALE_SUFFIX)
    mlp = model.model.layers[0].mlp
    mlp = getattr(mlp, "shared_mlp", mlp)
    for proj, rows, scale_rows in (
        (mlp.gate_proj, slice(0, 256), slice(0, 2)),
        (mlp.up_proj, slice(256, 512), slice(2, 4)),
    ):
        assert torch.equal(proj.weight.view(torch.uint8), w[rows].view(torch.uint8))
        assert torch.equal(proj.weight_scale_inv, s[scale_rows])
    m = float(cfg.residual_multiplier)
    assert m != 1.0
    assert torch.equal(mlp.down_proj.weight.view(torch.uint8), dw.view(torch.uint8))
    assert torch.equal(mlp.down_proj.weight_scale_inv, ds * m)
