"""`gpu_ops.triton_chosen`, the one rule for the `SGLANG_GPU_*_BACKEND` variables and the linear decode
choice: auto takes the Triton kernel on CUDA where it imports (else one warning and the torch form),
triton forces it anywhere, torch never; a bad value is one sentence naming the variable."""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.srt.environ import envs
from sglang.srt.layers import gpu_ops
from sglang.test.ci_register import register_cpu_ci

register_cpu_ci(est_time=1, suite="per-commit-cpu")

CUDA, CPU = torch.device("cuda"), torch.device("cpu")  # device objects need no GPU
KERNEL = "sglang.srt.layers.rmsnorm_triton"


def test_auto_takes_the_kernel_on_cuda_only():
    var = envs.SGLANG_GPU_NORM_BACKEND
    with var.override("auto"):
        assert gpu_ops.triton_chosen(var, CUDA, KERNEL) and not gpu_ops.triton_chosen(var, CPU, KERNEL)
    with var.override("triton"):
        assert gpu_ops.triton_chosen(var, CPU, KERNEL)
    with var.override("torch"):
        assert not gpu_ops.triton_chosen(var, CUDA, KERNEL)
    with var.override("fast"), pytest.raises(ValueError, match="SGLANG_GPU_NORM_BACKEND"):
        gpu_ops.triton_chosen(var, CUDA, KERNEL)


def test_a_kernel_that_cannot_import_falls_back_once_under_auto(caplog, monkeypatch):
    var = envs.SGLANG_GPU_ROPE_BACKEND
    monkeypatch.setattr(gpu_ops, "_warned", set())
    with var.override("auto"), caplog.at_level(logging.WARNING, logger=gpu_ops.__name__):
        assert not gpu_ops.triton_chosen(var, CUDA, "no_such_kernel_module")
        assert not gpu_ops.triton_chosen(var, CUDA, "no_such_kernel_module")
    assert caplog.text.count("SGLANG_GPU_ROPE_BACKEND: the Triton kernels are unavailable") == 1
    with var.override("triton"), pytest.raises(ModuleNotFoundError):
        gpu_ops.triton_chosen(var, CUDA, "no_such_kernel_module")
